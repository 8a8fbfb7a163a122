#!/usr/bin/env bash
# Registers gVisor's runsc with the local Docker engine, so sandboxes can run under it
# with CODEBROKER_RUNTIME=runsc. Idempotent: installs Debian's runsc package when it is
# missing, merges the runtime into /etc/docker/daemon.json without touching other keys,
# and reloads the daemon with SIGHUP (runtimes are reloadable; running containers stay).
#
#   scripts/runsc-up.sh        # after ../shared/scripts/docker-up.sh (or any running dockerd)
#
# --network=none: runsc refuses containers started with Docker's `none` network otherwise.
# --platform=ptrace: works without KVM, in a VM or a container.
# --host-uds=open: sandboxed code may connect to a host Unix socket bind-mounted into its
# container: the egress proxy's socket (CODEBROKER_EGRESS); it cannot create one there.
set -euo pipefail

RUNSC=${RUNSC:-/usr/bin/runsc}
DAEMON_JSON=${DAEMON_JSON:-/etc/docker/daemon.json}

say() { printf 'runsc-up: %s\n' "$*" >&2; }

if [ ! -x "$RUNSC" ]; then
  say "installing runsc from Debian"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq runsc >/dev/null
fi
say "$("$RUNSC" --version | head -1)"

registered() { docker info --format '{{json .Runtimes}}' 2>/dev/null | grep -q '"runsc"'; }

# Merge: keep every key already there; only the runsc entry is set.
mkdir -p "$(dirname "$DAEMON_JSON")"
changed=$(python3 - "$DAEMON_JSON" "$RUNSC" <<'PY'
import json, os, sys
path, runsc = sys.argv[1], sys.argv[2]
conf = {}
if os.path.exists(path) and os.path.getsize(path) > 0:
    with open(path) as f:
        conf = json.load(f)
want = {"path": runsc, "runtimeArgs": ["--platform=ptrace", "--network=none", "--host-uds=open"]}
if conf.get("runtimes", {}).get("runsc") == want:
    print("no")
else:
    conf.setdefault("runtimes", {})["runsc"] = want
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(conf, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
    print("yes")
PY
)

if [ "$changed" = no ] && registered; then
  say "runsc already registered"
  exit 0
fi

pid=$(pidof dockerd) || { say "dockerd is not running"; exit 1; }
say "reloading dockerd ($pid) with SIGHUP"
kill -HUP "$pid"
for _ in $(seq 1 30); do
  registered && { say "runsc registered: $(docker info --format '{{range $k, $v := .Runtimes}}{{$k}} {{end}}')"; exit 0; }
  sleep 1
done
say "runsc not listed by docker info after reload; see the daemon log"
exit 1
