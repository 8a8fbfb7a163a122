"""Open WebUI's code interpreter against codebroker's /jupyter, through Open WebUI's own
function (open_webui.utils.code_interpreter.execute_code_jupyter, pinned in the Makefile):
what a chat user gets back for output, plots, results and errors, and that each call runs
in a sandbox of its own that is gone afterwards."""

import asyncio
import base64
import os
import re
import struct
import time

import pytest

# open_webui.env refuses to import without a secret; the value is never used here.
os.environ.setdefault("WEBUI_SECRET_KEY", "codebroker-jupyter-suite")

from open_webui.utils.code_interpreter import execute_code_jupyter  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DATA_URI = "data:image/png;base64,"


def run(broker, code, token=None, timeout=60):
    """One call as Open WebUI makes it; bounded so a hung socket fails the test."""
    call = execute_code_jupyter(
        f"{broker.root}/jupyter", code, token=broker.key if token is None else token,
        timeout=timeout,
    )
    return asyncio.run(asyncio.wait_for(call, timeout + 30))


def png_size(data_uri):
    """Width and height of a PNG data URI, after checking it is one."""
    assert data_uri.startswith(DATA_URI), data_uri[:80]
    png = base64.b64decode(data_uri[len(DATA_URI):], validate=True)
    assert png[:8] == PNG_MAGIC, png[:16]
    assert png[12:16] == b"IHDR"
    return struct.unpack(">II", png[16:24])


def test_print_comes_back_as_stdout(broker):
    assert run(broker, "print('hello')") == {"stdout": "hello", "stderr": "", "result": ""}


def test_a_loop_s_lines_come_back_in_order(broker):
    out = run(broker, "for i in range(5):\n    print(f'line {i}')")
    assert out == {
        "stdout": "line 0\nline 1\nline 2\nline 3\nline 4", "stderr": "", "result": "",
    }


def test_plt_show_comes_back_as_a_png(broker):
    code = "import matplotlib.pyplot as plt\nplt.plot([1, 4, 9])\nplt.title('squares')\nplt.show()"
    out = run(broker, code)
    assert out["stdout"] == "" and out["stderr"] == "", out
    # One image and nothing else: plt.show() returns None, so there is no text result.
    assert out["result"].count(DATA_URI) == 1, out["result"][:200]
    assert "\n" not in out["result"]
    # matplotlib's default figure: 6.4 x 4.8 in at 100 dpi.
    assert png_size(out["result"]) == (640, 480)


def test_a_figure_left_open_at_the_end_comes_back_as_a_png(broker):
    # No plt.show(): the figure still open when the cell ends is shown, as in Jupyter.
    code = (
        "import matplotlib.pyplot as plt\n"
        "fig, ax = plt.subplots(figsize=(4, 3))\n"
        "_ = ax.plot([3, 1, 2])"
    )
    out = run(broker, code)
    assert out["stdout"] == "" and out["stderr"] == "", out
    assert out["result"].count(DATA_URI) == 1, out["result"][:200]
    # The size proves it is this cell's figure, not a default one.
    assert png_size(out["result"]) == (400, 300)


def test_a_trailing_expression_is_the_result(broker):
    assert run(broker, "x = 21\nx * 2") == {"stdout": "", "stderr": "", "result": "42"}
    # text/plain is the value's repr, as Jupyter shows it.
    assert run(broker, "'abc'.upper()")["result"] == "'ABC'"


def test_an_exception_comes_back_as_its_traceback_in_stderr(broker):
    code = "def divide(a, b):\n    return a / b\n\nprint('before')\ndivide(1, 0)"
    out = run(broker, code)
    assert out["stdout"] == "before"
    assert out["result"] == ""
    lines = out["stderr"].splitlines()
    assert lines[0] == "Traceback (most recent call last):", out["stderr"]
    assert lines[-1] == "ZeroDivisionError: division by zero", out["stderr"]
    # The frames of the user's code are there, with the failing line.
    assert any("in divide" in line for line in lines), out["stderr"]
    assert any("return a / b" in line for line in lines), out["stderr"]


def test_a_wrong_token_is_refused_before_any_kernel_starts(broker):
    before = broker.kernel_ids()
    out = run(broker, "print('should not run')", token="not-the-key")
    # Open WebUI catches the failed create and reports it as "Error: <the exception>".
    assert out["stdout"] == "" and out["result"] == "", out
    assert out["stderr"].startswith("Error:"), out
    assert "401" in out["stderr"], out
    assert broker.kernel_ids() == before


@pytest.mark.parametrize(
    "target",
    [("pypi.org", 443), ("1.1.1.1", 53)],
    ids=["by-name", "by-address"],
)
def test_a_cell_cannot_reach_the_network(broker, target):
    code = (
        "import socket\n"
        f"s = socket.create_connection({target!r}, timeout=5)\n"
        "print('connected to', s.getpeername())"
    )
    started = time.monotonic()
    out = run(broker, code)
    assert "connected" not in out["stdout"], out
    # The failure is the connection's own exception (no DNS, no route, refused or timed
    # out), not a sandbox error.
    last = out["stderr"].splitlines()[-1] if out["stderr"] else ""
    assert re.match(
        r"^(socket\.gaierror|socket\.timeout|TimeoutError|OSError|ConnectionRefusedError|"
        r"ConnectionResetError|PermissionError): ",
        last,
    ), out
    assert time.monotonic() - started < 30


def test_each_call_runs_in_a_new_kernel_that_is_deleted_after(broker):
    before = broker.kernel_ids()
    first = run(broker, "import socket\nsecret = 'kept?'\nprint(socket.gethostname())")
    assert first["stderr"] == "", first
    # Open WebUI deletes its kernel at the end of the call: none is left listed.
    assert broker.kernel_ids() == before
    second = run(broker, "import socket\nprint(socket.gethostname())\nprint(secret)")
    assert broker.kernel_ids() == before
    host_1, host_2 = first["stdout"], second["stdout"]
    assert host_1 and host_2 and host_1 != host_2, (first, second)
    assert second["stderr"].splitlines()[-1] == "NameError: name 'secret' is not defined", second


def test_two_concurrent_calls_share_no_state(broker):
    # Both run at once (each sleeps while the other writes): a shared kernel or workspace
    # would show the other's variable or file.
    def cell(mark):
        return (
            "import time\n"
            "start = time.time()\n"
            f"mark = {mark!r}\n"
            f"open('/mnt/data/mark.txt', 'w').write({mark!r})\n"
            "time.sleep(2)\n"
            "print(mark, open('/mnt/data/mark.txt').read())\n"
            "print(start, time.time())"
        )

    async def both():
        return await asyncio.gather(
            execute_code_jupyter(f"{broker.root}/jupyter", cell("A"), token=broker.key, timeout=60),
            execute_code_jupyter(f"{broker.root}/jupyter", cell("B"), token=broker.key, timeout=60),
        )

    before = broker.kernel_ids()
    a, b = asyncio.run(asyncio.wait_for(both(), 90))
    assert a["stderr"] == "" and b["stderr"] == "", (a, b)
    a_lines, b_lines = a["stdout"].splitlines(), b["stdout"].splitlines()
    assert a_lines[0] == "A A", a
    assert b_lines[0] == "B B", b
    # The two cells overlapped in time (sandboxes share the host's clock), so the
    # isolation was tested while both lived.
    a_start, a_end = map(float, a_lines[1].split())
    b_start, b_end = map(float, b_lines[1].split())
    assert a_start < b_end and b_start < a_end, (a_lines, b_lines)
    assert broker.kernel_ids() == before
