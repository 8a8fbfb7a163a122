"""Starts one codebroker (target/debug/codebroker, or CODEBROKER_BIN) for the E2B suite, as an
operator runs it, and points E2B's SDKs at it the documented way: E2B_API_URL,
E2B_SANDBOX_URL and a codebroker API key as E2B_API_KEY. Everything it made is removed at
the end."""

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _instance_label():
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


def start_broker(name, **env):
    port = _free_port()
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
        "CODEBROKER_POOL_SIZE": env.pop("pool_size", "1"),
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
    b = start_broker("e2b")
    old = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN")}
    os.environ["E2B_API_URL"] = f"{b.root}/e2b"
    os.environ["E2B_SANDBOX_URL"] = f"{b.root}/e2b/sandbox"
    os.environ["E2B_API_KEY"] = b.key
    os.environ.pop("E2B_DOMAIN", None)
    yield b
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    stop_broker(b)
