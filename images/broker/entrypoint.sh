#!/bin/sh
# Entrypoint of the broker image: runs codebroker as a uid of its own.
#
# The container starts as root for three things only: the data directory (a bind mount
# the engine may have created as root) is handed to the broker's uid and closed to every
# other user, the broker is given the group that owns the Docker socket, whatever its gid
# is on this host, and it keeps the three capabilities it needs. Then setpriv drops root
# for good.
#
# The broker's uid (10002) is no sandbox's: each sandbox runs as a uid of its own from
# CODEBROKER_SANDBOX_UIDS (200000-265535; the broker refuses a range holding its uid), or
# all as CODEBROKER_SANDBOX_UID when that is set. Code that escapes its container owns
# neither the data directory nor a process with the Docker socket, nor another sandbox's
# processes, and read-only uploads are the broker's files, which the code can read but
# not change. To hand each workspace to the sandbox uid and to read and remove whatever the
# code creates, the broker keeps CAP_CHOWN, CAP_DAC_OVERRIDE and CAP_FOWNER (ambient, so
# they survive the exec; nothing else is in its bounding set, and it clears the ambient set
# at start so that no program it starts inherits them). It also keeps CAP_SETUID and
# CAP_SETGID, permitted but not effective (it drops them from its effective and
# inheritable sets at start): only the child that starts a stdio: upstream MCP server raises
# them, to become CODEBROKER_CODEMODE_MCP_UID (10003) with no groups, then drops every
# capability before the exec. An upstream server then owns none of the data directory and
# is not in the Docker socket's group. A root helper would do the same with a root process
# and a protocol of its own; a broker compromise already reaches the Docker socket, so these
# two capabilities add nothing to it.
#
# CODEBROKER_RUN_AS_ROOT=true keeps root (with the container's capabilities).
set -eu

socket=${DOCKER_HOST:-unix:///var/run/docker.sock}
socket=${socket#unix://}
data=${CODEBROKER_DATA_DIR:-/var/lib/codebroker}
sandbox=${CODEBROKER_SANDBOX_UID:-}
broker=10002

if [ "$(id -u)" != 0 ] || [ "${CODEBROKER_RUN_AS_ROOT:-false}" = true ]; then
  exec codebroker "$@"
fi
if [ -n "$sandbox" ] && { [ "$sandbox" = "$broker" ] || [ "$sandbox" = 0 ]; }; then
  echo "codebroker-entrypoint: CODEBROKER_SANDBOX_UID must be neither $broker (the broker's uid) nor 0" >&2
  exit 1
fi

mkdir -p "$data"
# A data directory left by an older image (owned by the sandbox uid) or a root broker is
# handed over once: everything but the inside of the workspaces, which stays the
# sandbox's; the workspaces themselves become the broker's, sticky, group of the one
# sandbox uid if set (else the broker gives each the group of the sandbox it starts on
# it, and hands that sandbox what older ones left inside).
if [ "$(stat -c %u "$data")" != "$broker" ]; then
  find "$data" -path "$data/sessions/*/files" -prune -o -exec chown -h "$broker:$broker" {} +
  if [ -d "$data/sessions" ]; then
    find "$data/sessions" -mindepth 2 -maxdepth 2 -name files -type d \
      -exec chown -h "$broker${sandbox:+:$sandbox}" {} + -exec chmod 1770 {} +
  fi
fi
chmod 0700 "$data"
groups=$broker
if [ -S "$socket" ]; then
  groups="$broker,$(stat -c %g "$socket")"
else
  echo "codebroker-entrypoint: no Docker socket at $socket" >&2
fi
caps=-all,+chown,+dac_override,+fowner,+setuid,+setgid
exec setpriv --reuid="$broker" --regid="$broker" --groups="$groups" \
  --inh-caps="$caps" --ambient-caps="$caps" --bounding-set="$caps" --no-new-privs \
  -- codebroker "$@"
