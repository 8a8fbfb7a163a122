"""Starts one codebroker (target/debug/codebroker, or CODEBROKER_BIN) for the Jupyter suite,
as an operator runs it, with API-key auth: the key is the token Jupyter's clients send
(`?token=` from Open WebUI, `Authorization: token` from Jupyter Server's gateway client).
Everything it made is removed at the end."""

import json
import os
import sys
import urllib.error
import urllib.request

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "pyharness"))
from codebroker_child import (  # noqa: E402
    Broker, free_port, log_tail, start_broker, stop_broker, wait_until_up,
)

# free_port, log_tail and wait_until_up: test_jupyter_server.py imports them from here.


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


class JupyterBroker(Broker):
    def kernel_ids(self):
        """The ids codebroker's own /jupyter/api/kernels lists for the key."""
        status, kernels = http("GET", f"{self.root}/jupyter/api/kernels", token=self.key)
        assert status == 200, (status, kernels)
        return sorted(k["id"] for k in kernels)


@pytest.fixture(scope="session")
def broker():
    b = start_broker(
        "jupyter",
        cls=JupyterBroker,
        # Open WebUI makes a kernel per call, and two run at once in one test: a pool of
        # two keeps most creates off a cold container start.
        CODEBROKER_POOL_SIZE="2",
        # Two kernels of one key at once need a user's share (25 %) of at least two
        # sandboxes: `auto` allows its minimum of two on Kubernetes (it cannot see the
        # nodes), and on a small Docker host.
        CODEBROKER_MAX_CONTAINERS=os.environ.get("CODEBROKER_MAX_CONTAINERS", "8"),
    )
    yield b
    stop_broker(b)
