"""Starts one codebroker (target/debug/codebroker, or CODEBROKER_BIN) for the E2B suite, as an
operator runs it, and points E2B's SDKs at it the documented way: E2B_API_URL,
E2B_SANDBOX_URL and a codebroker API key as E2B_API_KEY. Everything it made is removed at
the end."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "pyharness"))
from codebroker_child import start_broker, stop_broker  # noqa: E402


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
