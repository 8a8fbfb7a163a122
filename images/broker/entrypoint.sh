#!/bin/sh
# Entrypoint of the broker image: runs codebroker as an unprivileged user.
#
# The container starts as root for two things only: the data directory (a bind mount
# the engine may have created as root) is handed to the broker's uid, and the broker is
# given the group that owns the Docker socket, whatever its gid is on this host. Then
# setpriv drops root for good. The broker's uid is the sandbox uid
# (CODEBROKER_SANDBOX_UID), so the workspaces it creates are the sandboxes' own without
# a chown, which only root could do.
#
# CODEBROKER_RUN_AS_ROOT=true keeps root: then read-only uploads are owned by root inside
# the sandbox instead of by the sandbox uid.
set -eu

socket=${DOCKER_HOST:-unix:///var/run/docker.sock}
socket=${socket#unix://}
data=${CODEBROKER_DATA_DIR:-/var/lib/codebroker}
uid=${CODEBROKER_SANDBOX_UID:-10001}

if [ "$(id -u)" != 0 ] || [ "${CODEBROKER_RUN_AS_ROOT:-false}" = true ]; then
  exec codebroker "$@"
fi

mkdir -p "$data"
# A data directory left by a root broker is handed over whole, once.
if [ "$(stat -c %u "$data")" != "$uid" ]; then
  chown -R "$uid:$uid" "$data"
fi
groups=$uid
if [ -S "$socket" ]; then
  groups="$uid,$(stat -c %g "$socket")"
else
  echo "codebroker-entrypoint: no Docker socket at $socket" >&2
fi
exec setpriv --reuid="$uid" --regid="$uid" --groups="$groups" \
  --inh-caps=-all --bounding-set=-all --no-new-privs -- codebroker "$@"
