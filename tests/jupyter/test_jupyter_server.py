"""A real Jupyter Server (jupyter_server, pinned in requirements.txt) with codebroker as its
kernel gateway (--GatewayClient.url, the key as --GatewayClient.auth_token): the tests
talk only to Jupyter Server, its REST API and its kernel WebSocket with legacy JSON
messages, as JupyterLab would, and check what codebroker did behind it."""

import base64
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import pytest
from websockets.sync.client import connect

from conftest import free_port, http, log_tail, wait_until_up

# How long one cell may take to come back; the interrupted ones sleep far longer.
CELL_TIMEOUT = 30
# How soon an interrupt must end a running cell.
INTERRUPT_WITHIN = 10


class JupyterServer:
    def __init__(self, port, token, log, kernel_mark):
        self.base = f"http://127.0.0.1:{port}"
        self.ws_base = f"ws://127.0.0.1:{port}"
        self.token = token
        self.log = log
        # The value of KERNEL_SUITE_MARK in its environment, which its gateway client
        # passes on in every kernel create (it forwards KERNEL_* variables).
        self.kernel_mark = kernel_mark

    def api(self, method, path, body=None):
        return http(method, f"{self.base}{path}", token=self.token, body=body, timeout=60)

    def log_tail(self):
        return log_tail(self.log)


@pytest.fixture(scope="module")
def server(broker):
    port = free_port()
    token = secrets.token_hex(16)
    home = tempfile.mkdtemp(prefix="codebroker-jupyter-server-")
    log = os.path.join(home, "jupyter-server.log")
    # Its runtime, data and config directories in the temporary home, so nothing of the
    # user's Jupyter setup is read or written; no gateway settings from the environment.
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER_")}
    kernel_mark = secrets.token_hex(8)
    env.update(
        KERNEL_SUITE_MARK=kernel_mark,
        JUPYTER_RUNTIME_DIR=os.path.join(home, "runtime"),
        JUPYTER_DATA_DIR=os.path.join(home, "data"),
        JUPYTER_CONFIG_DIR=os.path.join(home, "config"),
    )
    root_dir = os.path.join(home, "notebooks")
    os.makedirs(root_dir)
    argv = [
        sys.executable, "-m", "jupyter_server",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        "--ServerApp.ip=127.0.0.1",
        "--ServerApp.open_browser=False",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root_dir}",
        f"--GatewayClient.url={broker.root}/jupyter",
        f"--GatewayClient.auth_token={broker.key}",
        # Containers and CI often run as root, which Jupyter Server refuses by default.
        "--allow-root",
    ]
    with open(log, "wb") as out:
        child = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    js = JupyterServer(port, token, log, kernel_mark)
    wait_until_up(
        child, lambda: http("GET", f"{js.base}/api", timeout=2)[0] == 200, "jupyter server", log,
    )
    yield js
    child.terminate()
    try:
        child.wait(timeout=30)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def kernel(server):
    status, model = server.api("POST", "/api/kernels", {"name": "python3"})
    assert status == 201, (status, model, server.log_tail())
    yield model["id"]
    # Gone already when the test deleted it; a 404 then is fine.
    server.api("DELETE", f"/api/kernels/{model['id']}")


class Channels:
    """Jupyter Server's kernel WebSocket, legacy JSON frames; every message is kept, so a
    reply read while waiting for another request's is found later."""

    def __init__(self, ws):
        self.ws = ws
        self.session = uuid.uuid4().hex
        self.received = []

    def send(self, msg_type, content, channel="shell"):
        msg_id = uuid.uuid4().hex
        self.ws.send(json.dumps({
            "header": {
                "msg_id": msg_id, "msg_type": msg_type, "username": "test",
                "session": self.session, "date": "", "version": "5.3",
            },
            "parent_header": {}, "metadata": {}, "content": content, "channel": channel,
        }))
        return msg_id

    def messages(self, msg_id, done, timeout=CELL_TIMEOUT):
        """The messages answering `msg_id`, read until `done(them)` holds."""
        deadline = time.monotonic() + timeout
        while True:
            mine = [m for m in self.received if m.get("parent_header", {}).get("msg_id") == msg_id]
            if done(mine):
                return mine
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out after {timeout} s; got {summary(mine)}")
            try:
                self.received.append(json.loads(self.ws.recv(timeout=left)))
            except TimeoutError:
                raise AssertionError(f"timed out after {timeout} s; got {summary(mine)}") from None

    def execute(self, code):
        return self.send("execute_request", {
            "code": code, "silent": False, "store_history": True, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": True,
        })

    def result(self, msg_id, timeout=CELL_TIMEOUT):
        """A cell's messages once both its execute_reply and its idle status are in."""
        return Cell(self.messages(msg_id, cell_done, timeout))

    def run(self, code, timeout=CELL_TIMEOUT):
        return self.result(self.execute(code), timeout)


def cell_done(messages):
    return any(m["msg_type"] == "execute_reply" for m in messages) and any(
        m["msg_type"] == "status" and m["content"]["execution_state"] == "idle" for m in messages
    )


def summary(messages):
    return [(m.get("channel"), m.get("msg_type"), m.get("content")) for m in messages]


class Cell:
    def __init__(self, messages):
        self.messages = messages
        replies = [m for m in messages if m["msg_type"] == "execute_reply"]
        assert len(replies) == 1, summary(messages)
        assert replies[0]["channel"] == "shell", summary(messages)
        self.reply = replies[0]["content"]
        self.stdout = "".join(
            m["content"]["text"] for m in messages
            if m["msg_type"] == "stream" and m["content"]["name"] == "stdout"
        )
        self.errors = [m["content"] for m in messages if m["msg_type"] == "error"]
        self.results = [m["content"] for m in messages if m["msg_type"] == "execute_result"]

    def __repr__(self):
        return repr(summary(self.messages))


@pytest.fixture
def channels(server, kernel):
    url = f"{server.ws_base}/api/kernels/{kernel}/channels?token={server.token}"
    with connect(url, open_timeout=30, close_timeout=5, max_size=None) as ws:
        yield Channels(ws)


def test_kernelspecs_through_jupyter_server_are_codebroker_s(server):
    status, specs = server.api("GET", "/api/kernelspecs")
    assert status == 200, (status, specs)
    assert specs["default"] == "python3"
    assert list(specs["kernelspecs"]) == ["python3"]
    spec = specs["kernelspecs"]["python3"]["spec"]
    # codebroker's spec, not a local kernel's.
    assert spec["display_name"] == "Python 3 (codebroker sandbox)"
    assert spec["language"] == "python"


def test_a_kernel_made_through_jupyter_server_is_codebroker_s(server, broker):
    before = broker.kernel_ids()
    status, model = server.api("POST", "/api/kernels", {"name": "python3"})
    assert status == 201, (status, model)
    try:
        assert model["name"] == "python3"
        assert sorted(set(broker.kernel_ids()) - set(before)) == [model["id"]]
        status, got = server.api("GET", f"/api/kernels/{model['id']}")
        assert status == 200 and got["id"] == model["id"], (status, got)
        status, listed = server.api("GET", "/api/kernels")
        assert status == 200 and model["id"] in [k["id"] for k in listed], listed
    finally:
        server.api("DELETE", f"/api/kernels/{model['id']}")


def test_kernel_info_through_jupyter_server_is_codebroker_s(channels):
    # What JupyterLab asks first on every connection.
    request = channels.send("kernel_info_request", {})
    messages = channels.messages(request, lambda ms: any(
        m["msg_type"] == "status" and m["content"]["execution_state"] == "idle" for m in ms
    ), timeout=10)
    replies = [m for m in messages if m["msg_type"] == "kernel_info_reply"]
    assert len(replies) == 1, summary(messages)
    info = replies[0]["content"]
    assert replies[0]["channel"] == "shell"
    assert info["status"] == "ok" and info["implementation"] == "codebroker", info
    assert info["protocol_version"] == "5.3"
    assert info["language_info"]["name"] == "python"


def test_the_kernel_env_jupyter_server_sends_is_set_before_the_first_cell(server, channels):
    cell = channels.run("import os\nprint(os.environ['KERNEL_SUITE_MARK'])")
    assert cell.reply["status"] == "ok", cell
    assert cell.stdout == f"{server.kernel_mark}\n", cell


def test_state_carries_over_from_cell_to_cell(channels):
    first = channels.run("x = 41")
    assert first.reply["status"] == "ok" and first.reply["execution_count"] == 1, first
    assert first.stdout == "" and first.errors == [] and first.results == [], first
    second = channels.run("print(x + 1)")
    assert second.reply["status"] == "ok" and second.reply["execution_count"] == 2, second
    assert second.stdout == "42\n", second
    # Jupyter's order within a cell: busy first, idle after every output (Open WebUI
    # stops reading at idle).
    iopub = [(m["msg_type"], m["content"]) for m in second.messages if m["channel"] == "iopub"]
    assert iopub[0] == ("status", {"execution_state": "busy"}), second
    assert iopub[-1] == ("status", {"execution_state": "idle"}), second
    assert [t for t, _ in iopub].count("status") == 2, second
    inputs = [m["content"] for m in second.messages if m["msg_type"] == "execute_input"]
    assert inputs == [{"code": "print(x + 1)", "execution_count": 2}], second


def test_a_trailing_expression_is_an_execute_result(channels):
    cell = channels.run("x = 6\nx * 7")
    assert cell.reply["status"] == "ok", cell
    assert cell.stdout == "", cell
    assert len(cell.results) == 1, cell
    assert cell.results[0]["data"]["text/plain"] == "42"
    assert cell.results[0]["execution_count"] == cell.reply["execution_count"] == 1


def test_rich_output_comes_as_mime_bundles(channels):
    # What JupyterLab renders: a DataFrame as HTML beside its text, a shown figure as a PNG.
    frame = channels.run("import pandas as pd\npd.DataFrame({'a': [1, 2]})")
    assert frame.reply["status"] == "ok" and len(frame.results) == 1, frame
    data = frame.results[0]["data"]
    assert data["text/plain"] == "   a\n0  1\n1  2", data
    assert "<table" in data["text/html"] and "</table>" in data["text/html"], data
    plot = channels.run("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()")
    assert plot.reply["status"] == "ok" and plot.results == [], plot
    shown = [m["content"]["data"] for m in plot.messages if m["msg_type"] == "display_data"]
    assert len(shown) == 1, plot
    assert base64.b64decode(shown[0]["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"


def test_cells_queued_behind_a_failing_one_are_aborted(channels):
    # JupyterLab's "Run All" sends every cell at once; after an error the rest do not run.
    sent = [channels.execute(code) for code in ("a = 1", "1 / 0", "print('never')", "a")]
    cells = [channels.result(msg_id) for msg_id in sent]
    assert [c.reply["status"] for c in cells] == ["ok", "error", "aborted", "aborted"], cells
    assert cells[1].reply["ename"] == "ZeroDivisionError"
    assert all(c.stdout == "" and c.results == [] for c in cells), cells
    # The kernel goes on: the next cell runs, with the state of the ones that ran.
    after = channels.run("print(a)")
    assert after.reply["status"] == "ok" and after.stdout == "1\n", after


def test_a_second_socket_sees_the_first_one_s_output_but_not_its_replies(server, kernel, channels):
    # Two browser tabs on one notebook: iopub goes to both, the reply to the asker only.
    url = f"{server.ws_base}/api/kernels/{kernel}/channels?token={server.token}"
    with connect(url, open_timeout=30, close_timeout=5) as ws:
        other = Channels(ws)
        # Jupyter Server opens its socket to the gateway after accepting the client's: a
        # round trip first (as JupyterLab's kernel_info on connect) makes sure it is open.
        info = other.send("kernel_info_request", {})
        other.messages(
            info, lambda ms: any(m["msg_type"] == "kernel_info_reply" for m in ms), timeout=10,
        )
        msg_id = channels.execute("print('from the first tab')")
        assert channels.result(msg_id).stdout == "from the first tab\n"
        seen = other.messages(msg_id, lambda ms: any(
            m["msg_type"] == "status" and m["content"]["execution_state"] == "idle" for m in ms
        ), timeout=10)
        types = [m["msg_type"] for m in seen]
        assert types == ["status", "execute_input", "stream", "status"], summary(seen)
        assert seen[2]["content"] == {"name": "stdout", "text": "from the first tab\n"}
        assert all(m["channel"] == "iopub" for m in seen)


def start_sleeping_cell(channels):
    """Starts a cell that sleeps a minute, and returns once its code runs (it printed), so
    the interrupt reaches a running cell, not one still starting."""
    msg_id = channels.execute("import time\nprint('sleeping', flush=True)\ntime.sleep(60)")
    channels.messages(msg_id, lambda ms: any(
        m["msg_type"] == "stream" and "sleeping" in m["content"]["text"] for m in ms
    ))
    return msg_id


def assert_interrupted(cell):
    assert cell.reply["status"] == "error", cell
    assert cell.reply["ename"] == "KeyboardInterrupt", cell
    assert [e["ename"] for e in cell.errors] == ["KeyboardInterrupt"], cell


def test_an_interrupt_through_the_rest_api_stops_the_cell_and_keeps_the_state(
    server, kernel, channels,
):
    assert channels.run("x = 41").reply["status"] == "ok"
    msg_id = start_sleeping_cell(channels)
    interrupted_at = time.monotonic()
    status, _ = server.api("POST", f"/api/kernels/{kernel}/interrupt")
    assert status == 204, status
    cell = channels.result(msg_id, timeout=INTERRUPT_WITHIN)
    assert time.monotonic() - interrupted_at < INTERRUPT_WITHIN
    assert_interrupted(cell)
    after = channels.run("print(x)")
    assert after.reply["status"] == "ok" and after.stdout == "41\n", after


def test_an_interrupt_request_on_the_control_channel_stops_the_cell(channels):
    assert channels.run("x = 41").reply["status"] == "ok"
    msg_id = start_sleeping_cell(channels)
    interrupted_at = time.monotonic()
    request = channels.send("interrupt_request", {}, channel="control")
    cell = channels.result(msg_id, timeout=INTERRUPT_WITHIN)
    assert time.monotonic() - interrupted_at < INTERRUPT_WITHIN
    assert_interrupted(cell)
    replies = channels.messages(
        request, lambda ms: any(m["msg_type"] == "interrupt_reply" for m in ms), timeout=5,
    )
    reply = [m for m in replies if m["msg_type"] == "interrupt_reply"][0]
    assert reply["channel"] == "control" and reply["content"]["status"] == "ok", reply
    after = channels.run("print(x)")
    assert after.reply["status"] == "ok" and after.stdout == "41\n", after


def test_a_restart_through_jupyter_server_forgets_the_state(server, kernel, channels):
    assert channels.run("x = 41").reply["status"] == "ok"
    assert channels.run("print(x)").stdout == "41\n"
    status, model = server.api("POST", f"/api/kernels/{kernel}/restart")
    assert status == 200 and model["id"] == kernel, (status, model)
    cell = channels.run("print(x)")
    assert cell.reply["status"] == "error" and cell.reply["ename"] == "NameError", cell
    assert cell.errors[0]["evalue"] == "name 'x' is not defined", cell
    # The execution count starts again, as after a kernel restart in Jupyter.
    assert cell.reply["execution_count"] == 1, cell
    # The create's environment is set again in the new sandbox.
    env = channels.run("import os\nprint(os.environ['KERNEL_SUITE_MARK'])")
    assert env.stdout == f"{server.kernel_mark}\n", env


def test_a_delete_through_jupyter_server_ends_codebroker_s_kernel(server, broker, kernel):
    assert kernel in broker.kernel_ids()
    status, _ = server.api("DELETE", f"/api/kernels/{kernel}")
    assert status == 204, status
    assert kernel not in broker.kernel_ids()
    status, _ = http("GET", f"{broker.root}/jupyter/api/kernels/{kernel}", token=broker.key)
    assert status == 404, status
    status, _ = server.api("GET", f"/api/kernels/{kernel}")
    assert status == 404, status


def test_a_notebook_session_starts_and_ends_a_codebroker_kernel(server, broker):
    # What JupyterLab does when it opens a notebook, and when it shuts the notebook's
    # kernel down.
    before = broker.kernel_ids()
    status, session = server.api("POST", "/api/sessions", {
        "path": "analysis.ipynb", "name": "analysis.ipynb", "type": "notebook",
        "kernel": {"name": "python3"},
    })
    assert status == 201, (status, session)
    kernel = session["kernel"]["id"]
    try:
        assert sorted(set(broker.kernel_ids()) - set(before)) == [kernel]
        status, listed = server.api("GET", "/api/sessions")
        assert status == 200, (status, listed)
        assert [s["kernel"]["id"] for s in listed if s["id"] == session["id"]] == [kernel]
        status, _ = server.api("DELETE", f"/api/sessions/{session['id']}")
        assert status == 204, status
        assert broker.kernel_ids() == before
    finally:
        server.api("DELETE", f"/api/kernels/{kernel}")
