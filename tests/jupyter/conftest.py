"""Starts one codebroker (target/debug/codebroker, or CODEBROKER_BIN) for the Jupyter suite,
as an operator runs it, with API-key auth: the key is the token Jupyter's clients send
(`?token=` from Open WebUI, `Authorization: token` from Jupyter Server's gateway client).
Everything it made is removed at the end."""

import json
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

import pytest

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


def http(method, url, token=None, body=None, timeout=30):
    """One REST call: (status, parsed JSON or None). HTTP errors are answers, not raised:
    the tests assert on their status."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    if token is not None:
        request.add_header("Authorization", f"token {token}")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")


class Broker:
    def __init__(self, root, key, instance, data_dir, log):
        self.root = root
        self.key = key
        self.instance = instance
        self.data_dir = data_dir
        self.log = log

    def log_tail(self):
        with open(self.log, encoding="utf-8", errors="replace") as f:
            return f.read()[-4000:]

    def kernel_ids(self):
        """The ids codebroker's own /jupyter/api/kernels lists for the key."""
        status, kernels = http("GET", f"{self.root}/jupyter/api/kernels", token=self.key)
        assert status == 200, (status, kernels)
        return sorted(k["id"] for k in kernels)


def start_broker(name, **env):
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
        # Open WebUI makes a kernel per call, and two run at once in one test: a pool of
        # two keeps most creates off a cold container start.
        "CODEBROKER_POOL_SIZE": env.pop("pool_size", "2"),
        # Two kernels of one key at once need a user's share (25 %) of at least two
        # sandboxes: `auto` allows its minimum of two on Kubernetes (it cannot see the
        # nodes), and on a small Docker host.
        "CODEBROKER_MAX_CONTAINERS": os.environ.get("CODEBROKER_MAX_CONTAINERS", "8"),
        **env,
    }
    with open(log, "wb") as out:
        child = subprocess.Popen([binary], env=full_env, stdout=out, stderr=subprocess.STDOUT)
    root = f"http://127.0.0.1:{port}"
    broker = Broker(root, key, instance, data_dir, log)
    deadline = time.time() + 60
    while True:
        if child.poll() is not None:
            raise RuntimeError(f"codebroker exited before it was healthy:\n{broker.log_tail()}")
        try:
            with urllib.request.urlopen(f"{root}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.time() > deadline:
            child.kill()
            raise RuntimeError(f"codebroker was not healthy within 60 s:\n{broker.log_tail()}")
        time.sleep(0.2)
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


@pytest.fixture(scope="session")
def broker():
    b = start_broker("jupyter")
    yield b
    stop_broker(b)
