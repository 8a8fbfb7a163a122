"""The broker as a child process for the Python suites (tests/e2b, tests/jupyter): started
as an operator runs it (target/debug/codebroker, or CODEBROKER_BIN) with API-key auth on a
free port, its own data directory and instance label; stopped with everything it made
removed. The suites add this directory to sys.path in their conftest."""

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _instance_label():
    # On the Kubernetes backend the stand-in API server labels the pod's container.
    if os.environ.get("CODEBROKER_BACKEND", "").lower() == "kubernetes":
        return "k8s-standin.pod-label.codebroker.instance"
    return "codebroker.instance"


def remove_containers(instance):
    ids = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label={_instance_label()}={instance}"],
        capture_output=True, text=True, check=False,
    ).stdout.split()
    if ids:
        subprocess.run(["docker", "rm", "-f", *ids], capture_output=True, check=False)


def log_tail(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()[-4000:]


def wait_until_up(child, ready, what, log, timeout=60):
    """Polls `ready()` until it is true; fails with the log's end if `child` exits first or
    `timeout` seconds pass."""
    deadline = time.time() + timeout
    while True:
        if child.poll() is not None:
            raise RuntimeError(f"{what} exited before it was up:\n{log_tail(log)}")
        try:
            if ready():
                return
        except OSError:
            pass
        if time.time() > deadline:
            child.kill()
            raise RuntimeError(f"{what} was not up within {timeout} s:\n{log_tail(log)}")
        time.sleep(0.2)


class Broker:
    def __init__(self, root, key, instance, data_dir, log):
        self.root = root
        self.key = key
        self.instance = instance
        self.data_dir = data_dir
        self.log = log

    def log_tail(self):
        return log_tail(self.log)


def start_broker(name, cls=Broker, **env):
    """A broker named `name` (its instance label and data directory), with `env` over the
    defaults (a pool of one); an instance of `cls`."""
    port = free_port()
    data_dir = tempfile.mkdtemp(prefix=f"codebroker-{name}-")
    instance = f"{name}-test-{os.getpid()}-{port}"
    key = secrets.token_hex(16)
    binary = os.environ.get("CODEBROKER_BIN", os.path.join(REPO, "target", "debug", "codebroker"))
    log = os.path.join(data_dir, "broker.log")
    full_env = {
        **os.environ,
        "CODEBROKER_LISTEN": f"127.0.0.1:{port}",
        "CODEBROKER_AUTH": "key",
        "CODEBROKER_API_KEY": key,
        "CODEBROKER_DATA_DIR": os.path.join(data_dir, "data"),
        "CODEBROKER_INSTANCE": instance,
        "CODEBROKER_POOL_SIZE": "1",
        **env,
    }
    with open(log, "wb") as out:
        child = subprocess.Popen([binary], env=full_env, stdout=out, stderr=subprocess.STDOUT)
    root = f"http://127.0.0.1:{port}"

    def healthy():
        with urllib.request.urlopen(f"{root}/health", timeout=2) as r:
            return r.status == 200

    wait_until_up(child, healthy, "codebroker", log)
    broker = cls(root, key, instance, data_dir, log)
    broker.child = child
    return broker


def stop_broker(broker):
    broker.child.terminate()
    try:
        broker.child.wait(timeout=30)
    except subprocess.TimeoutExpired:
        broker.child.kill()
    remove_containers(broker.instance)
    if not os.environ.get("KEEP_BROKER_DATA"):
        shutil.rmtree(broker.data_dir, ignore_errors=True)
