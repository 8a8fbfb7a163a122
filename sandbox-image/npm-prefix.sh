#!/bin/sh
# /usr/local/bin/npm, ahead of Debian's /usr/bin/npm on PATH.
#
# npm installs into the nearest directory, from the working directory up, that holds a
# package.json or a node_modules. In a fresh workspace no directory below / does, and / does:
# the image's own packages are in /node_modules (read-only), so `npm install X` in /mnt/data
# would try to install into /node_modules. Unless a directory below / has either, or the
# command says where itself (--prefix, -g, --global, --location), npm is given
# --prefix "$PWD": X goes to ./node_modules, where node's require and import find it.
dir=$PWD
while [ -n "$dir" ] && [ "$dir" != / ]; do
    if [ -e "$dir/package.json" ] || [ -d "$dir/node_modules" ]; then
        exec /usr/bin/npm "$@"
    fi
    dir=${dir%/*}
done
for arg in "$@"; do
    case $arg in
        --) break ;;
        --prefix | --prefix=* | -g | --global | --global=* | --location | --location=*)
            exec /usr/bin/npm "$@" ;;
    esac
done
exec /usr/bin/npm --prefix "$PWD" "$@"
