"""Tests of kernel.py over its real protocol: requests on fd 3, events on fd 4.

In the image, with numpy and matplotlib (no pytest there; the file is not shipped, so it is
mounted): `make kernel-test`. On a host with numpy (matplotlib optional):
    python3 -m pytest sandbox-image/kernels/test_kernel.py

Each test starts its own kernel with a fresh temporary workspace (CODEBROKER_WORKDIR) and
matplotlib config dir (MPLCONFIGDIR). The plot test needs matplotlib; it is skipped without it.
"""

import fcntl
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL = os.environ.get("KERNEL_PY") or os.path.join(HERE, "kernel.py")

try:
    import pytest
except ImportError:  # running in the image: see main() below
    pytest = None


class Skip(Exception):
    pass


def skip(reason):
    if pytest is not None:
        pytest.skip(reason)
    raise Skip(reason)


def _build_mpl_cache():
    """A font cache to copy: the image's, or one made now in a temporary directory."""
    image_cache = "/opt/codebroker/mplconfig"
    if os.path.isdir(image_cache):
        return image_cache
    d = os.path.join(tempfile.gettempdir(), "codebroker-test-mplcache")
    if not os.path.isdir(d):
        tmp = tempfile.mkdtemp()
        env = dict(os.environ, MPLCONFIGDIR=tmp, MPLBACKEND="Agg")
        subprocess.run([sys.executable, "-c", "import matplotlib.font_manager"], env=env, check=False)
        os.replace(tmp, d)
    return d


class Kernel:
    """One kernel process with its pipes, like the runner starts it."""

    def __init__(self, mpl_cache=None, env=None, merged=False):
        """merged: stdout and stderr on one pipe (its output all shows as stdout), to see the
        order of their writes."""
        self.workdir = tempfile.mkdtemp(prefix="cb-work-")
        self.mplconfig = os.path.join(tempfile.mkdtemp(prefix="cb-mpl-"), "mplconfig")
        req_r, self.req_w = os.pipe()
        self.evt_r, evt_w = os.pipe()
        extra_env, env = env or {}, dict(os.environ)
        env.pop("PYTHONUNBUFFERED", None)  # the runner starts the kernel with the image's env
        env.update(extra_env)
        env.update(
            CODEBROKER_WORKDIR=self.workdir,
            MPLCONFIGDIR=self.mplconfig,
            MPLBACKEND="Agg",
            PYTHONDONTWRITEBYTECODE="1",
        )
        if mpl_cache:
            env["CODEBROKER_MPL_CACHE"] = mpl_cache

        def child():
            # Move the pipe ends to fds 3 and 4 (via high numbers, so nothing is clobbered).
            a = fcntl.fcntl(req_r, fcntl.F_DUPFD, 100)
            b = fcntl.fcntl(evt_w, fcntl.F_DUPFD, 100)
            os.dup2(a, 3)
            os.dup2(b, 4)
            os.close(a)
            os.close(b)

        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, KERNEL],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merged else subprocess.PIPE,
            cwd=self.workdir,
            env=env,
            close_fds=False,  # fds 3 and 4 are made in preexec_fn; os.pipe() fds are CLOEXEC
            preexec_fn=child,
            start_new_session=True,
        )
        os.close(req_r)
        os.close(evt_w)
        self.bufs = {"stdout": bytearray(), "stderr": bytearray(), "events": bytearray()}
        self.sel = selectors.DefaultSelector()
        for name, fd in (
            ("stdout", self.proc.stdout.fileno()),
            ("stderr", self.proc.stderr.fileno() if self.proc.stderr else None),
            ("events", self.evt_r),
        ):
            if fd is None:
                continue
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ, name)
        self.next_id = 1
        self.displays = []
        self.logs = []  # the messages of `log` events (a preload's failures)
        self.preloaded = []  # `preloaded` events (the preload thread ended)
        ready = self.event(timeout=30)
        self.start_time = time.monotonic() - self.started
        assert ready == {"event": "ready"}, ready

    # -- plumbing -----------------------------------------------------------------------

    def _pump(self, timeout):
        for key, _ in self.sel.select(timeout):
            self._drain(key.fd, key.data)

    def _drain(self, fd, name):
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return
            if not chunk:
                self.sel.unregister(fd)
                return
            self.bufs[name] += chunk

    def event(self, timeout=30):
        """The next event line from fd 4, or None at EOF/timeout."""
        deadline = time.monotonic() + timeout
        while True:
            buf = self.bufs["events"]
            i = buf.find(b"\n")
            if i >= 0:
                line = bytes(buf[:i])
                del buf[: i + 1]
                ev = json.loads(line)
                if ev.get("event") == "log":  # may come at any time: kept aside
                    assert set(ev) == {"event", "message"}, ev
                    self.logs.append(ev["message"])
                    continue
                if ev.get("event") == "preloaded":  # likewise
                    assert set(ev) == {"event", "stopped"}, ev
                    self.preloaded.append(ev)
                    continue
                return ev
            left = deadline - time.monotonic()
            if left <= 0 or not self.sel.get_map():
                return None
            self._pump(left)

    def take_output(self):
        # The kernel flushes stdout/stderr before it writes `done`, so everything is in the
        # pipes by now: drain them without waiting.
        for name, pipe in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr)):
            fd = pipe.fileno() if pipe else None
            if fd is not None and fd in self.sel.get_map():
                self._drain(fd, name)
        out = bytes(self.bufs["stdout"]).decode()
        err = bytes(self.bufs["stderr"]).decode()
        self.bufs["stdout"].clear()
        self.bufs["stderr"].clear()
        return out, err

    def send(self, code, args=(), req_id=None, ensure_ascii=True, **extra):
        if req_id is None:
            req_id = self.next_id
            self.next_id += 1
        req = {"id": req_id, "code": code, "args": list(args)}
        req.update(extra)  # tools, tool_socket
        line = json.dumps(req, ensure_ascii=ensure_ascii) + "\n"
        os.write(self.req_w, line.encode())
        return req_id

    def run(self, code, args=(), timeout=30, **extra):
        """Run code; (exit_code, stdout, stderr). Display events go to self.displays."""
        req_id = self.send(code, args, **extra)
        while True:
            ev = self.event(timeout)
            if ev is None or ev.get("event") != "display":
                break
            assert ev.get("id") == req_id, ev
            self.displays.append(ev)
        assert ev is not None, "no done within %ss" % timeout
        assert ev == {"event": "done", "id": req_id, "exit_code": ev.get("exit_code")}, ev
        out, err = self.take_output()
        return ev["exit_code"], out, err

    def state(self, kind, timeout=60, **fields):
        """A `save_state` or `restore_state` request; its answer, with `id` checked and
        dropped."""
        req_id = self.next_id
        self.next_id += 1
        req = {"type": kind, "id": req_id}
        req.update(fields)
        os.write(self.req_w, (json.dumps(req) + "\n").encode())
        ev = self.event(timeout)
        want = "state_saved" if kind == "save_state" else "state_restored"
        assert ev is not None and ev.pop("event") == want and ev.pop("id") == req_id, ev
        self.take_output()  # what pickling printed belongs to no exec
        return ev

    def preload(self, modules):
        """The runner's `preload` request (not answered)."""
        os.write(self.req_w, (json.dumps({"type": "preload", "modules": modules}) + "\n").encode())

    def interrupt(self):
        os.kill(self.proc.pid, signal.SIGINT)

    def close(self):
        try:
            os.close(self.req_w)
        except OSError:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.sel.close()
        os.close(self.evt_r)
        self.proc.stdout.close()
        if self.proc.stderr:
            self.proc.stderr.close()
        shutil.rmtree(self.workdir, ignore_errors=True)
        shutil.rmtree(os.path.dirname(self.mplconfig), ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def assert_ok(result, stdout):
    code, out, err = result
    assert (code, out) == (0, stdout), (code, out, err)


# -- start-up -------------------------------------------------------------------------------


def test_ready_fast_and_light():
    times = []
    for _ in range(3):
        with Kernel() as k:
            times.append(k.start_time)
            code, out, err = k.run(
                "import sys\n"
                "print(sorted(m for m in ('asyncio', 'matplotlib', 'numpy') if m in sys.modules))\n"
                "print(sorted(m for m in ('ast', 'enum', 'json', 're', 'linecache') if m in sys.modules))"
            )
            assert code == 0, err
            heavy, light = out.splitlines()
            assert heavy == "[]", out  # never imported unless the code asks for them
    # light: not imported by the kernel either (in the image; a host's site may import them)
    print("kernel start (spawn to ready): %s; light modules loaded: %s"
          % (", ".join("%.0f ms" % (t * 1000) for t in times), light))


def test_sources_for_traceback_module_and_inspect():
    with Kernel() as k:
        assert_ok(k.run("def double(x):\n    return 2 * x\n"), "")
        code, out, err = k.run(
            "import traceback, inspect, warnings\n"
            "try:\n    1 / 0\nexcept ZeroDivisionError:\n    traceback.print_exc()\n"
            "print(inspect.getsource(double), end='')\n"
            "warnings.warn('careful')\n"
        )
        assert code == 0, err
        assert out == "def double(x):\n    return 2 * x\n", out
        assert "    1 / 0\n" in err and "ZeroDivisionError" in err, err
        assert "UserWarning: careful" in err and "warnings.warn('careful')" in err, err


def test_eof_on_requests_ends_the_kernel():
    k = Kernel()
    os.close(k.req_w)
    assert k.proc.wait(5) == 0
    k.req_w = os.open(os.devnull, os.O_WRONLY)
    k.close()


# -- state and display ------------------------------------------------------------------------


def test_state_survives():
    with Kernel() as k:
        assert_ok(k.run("x = 41"), "")
        assert_ok(k.run("print(x + 1)"), "42\n")

        assert_ok(k.run("def f(a):\n    return a * 2\n"), "")
        assert_ok(k.run("f(21)"), "42\n")


def test_trailing_expression():
    with Kernel() as k:
        assert_ok(k.run("1 + 1"), "2\n")
        assert_ok(k.run("'abc'"), "'abc'\n")
        assert_ok(k.run("y = 3\ny * 2"), "6\n")
        assert_ok(k.run("None"), "")
        assert_ok(k.run("print('hi')"), "hi\n")  # print's None is not shown
        assert_ok(k.run("y"), "3\n")
        assert_ok(k.run("y;"), "")  # a trailing semicolon hides it, as in notebooks
        assert_ok(k.run("z = 5"), "")
        assert_ok(k.run(""), "")
        assert_ok(k.run("# only a comment\n"), "")
        assert_ok(k.run("if True:\n    7\n"), "")  # not a top-level expression


def test_rich_mode_shows_values_as_bundles_and_exceptions_as_events():
    bundle = "application/x.codebroker-bundle+json"
    with Kernel() as k:
        # Without it, a trailing expression is printed, as LibreChat's answer wants.
        assert_ok(k.run("21 * 2"), "42\n")
        assert k.displays == []
        code, out, err = k.run("x = 21\nx * 2", rich=True)
        assert (code, out, err) == (0, "", ""), (code, out, err)
        (shown,) = k.displays
        assert shown["mime"] == bundle
        assert json.loads(shown["data"]) == {"main": True, "data": {"text/plain": "42"}}
        k.displays.clear()
        code, out, err = k.run(
            "class R:\n"
            "    def _repr_html_(self): return '<b>r</b>'\n"
            "    def _repr_png_(self): return b'PNG'\n"
            "    def _repr_latex_(self): raise ValueError('no')\n"
            "    def __repr__(self): return 'R()'\n"
            "print('before')\n"
            "display(R())\n"
            "R()",
            rich=True,
        )
        assert (code, out, err) == (0, "before\n", ""), (code, out, err)
        first, main = (json.loads(d["data"]) for d in k.displays)
        assert first == {
            "main": False,
            "data": {"text/html": "<b>r</b>", "image/png": "UE5H", "text/plain": "R()"},
        }
        assert main["main"] is True
        k.displays.clear()
        code, out, err = k.run("1/0", rich=True)
        assert (code, out, err) == (1, "", ""), (code, out, err)
        (error,) = k.displays
        assert error["mime"] == "application/x.codebroker-error+json"
        payload = json.loads(error["data"])
        assert payload["name"] == "ZeroDivisionError"
        assert payload["value"] == "division by zero"
        assert "Traceback" in payload["traceback"] and "kernel.py" not in payload["traceback"]
        k.displays.clear()
        # SystemExit keeps its meaning: an exit code, not an error event.
        code, _, _ = k.run("raise SystemExit(3)", rich=True)
        assert code == 3 and k.displays == []


def test_main_namespace():
    with Kernel() as k:
        assert_ok(k.run("__name__"), "'__main__'\n")
        assert_ok(
            k.run(
                "import pickle, sys\n"
                "class P:\n    pass\n"
                "print(type(pickle.loads(pickle.dumps(P()))).__name__, sys.modules['__main__'].P is P)"
            ),
            "P True\n",
        )
        # the kernel's own globals are not in the user's namespace
        assert_ok(k.run("print(sorted(k for k in globals() if not k.startswith('__')))"), "['P', 'pickle', 'sys']\n")


# -- errors and exits --------------------------------------------------------------------------


def test_exception_traceback_without_kernel_frames():
    with Kernel() as k:
        code, out, err = k.run("a = 1\n1 / 0\n")
        assert code == 1
        assert out == ""
        assert err.startswith("Traceback (most recent call last):\n"), err
        assert "ZeroDivisionError: division by zero" in err
        assert '"<cell-1>", line 2, in <module>' in err
        assert "1 / 0" in err  # the source line is shown
        assert "kernel.py" not in err, err
        assert err.count("File ") == 1, err

        # a function from an earlier cell: both cells' lines are shown
        assert_ok(k.run("def boom():\n    raise ValueError('nope')\n"), "")
        code, out, err = k.run("boom()")
        assert code == 1
        assert "<cell-3>" in err and "<cell-2>" in err, err
        assert "raise ValueError('nope')" in err
        assert "ValueError: nope" in err
        assert "kernel.py" not in err, err

        assert_ok(k.run("print(a)"), "1\n")  # the kernel is still there


def test_bad_requests():
    with Kernel() as k:
        for line in (b"not json\n", b"[1, 2]\n", b'{"id": 7, "code": 5}\n', b"\n"):
            os.write(k.req_w, line)
            ev = k.event()
            assert ev["event"] == "done" and ev["exit_code"] == 1, ev
            assert ev["id"] in (None, 7), ev
            assert "bad request" in k.take_output()[1]
        assert_ok(k.run("print('fine')"), "fine\n")


def test_syntax_error():
    with Kernel() as k:
        code, out, err = k.run("x = (\n")
        assert code == 1
        assert "SyntaxError" in err, err
        assert "kernel.py" not in err and "Traceback" not in err, err
        assert_ok(k.run("1"), "1\n")


def test_repr_error_and_chained_exceptions():
    with Kernel() as k:
        code, out, err = k.run("class R:\n    def __repr__(self):\n        raise KeyError('r')\nR()")
        assert code == 1
        assert "KeyError: 'r'" in err and "__repr__" in err, err
        assert "kernel.py" not in err, err
        code, out, err = k.run("try:\n    {}['k']\nexcept KeyError as e:\n    raise RuntimeError('x') from e\n")
        assert code == 1
        assert "KeyError: 'k'" in err and "RuntimeError: x" in err and "direct cause" in err, err
        assert "kernel.py" not in err, err


def test_system_exit():
    with Kernel() as k:
        assert k.run("import sys\nprint('before')\nsys.exit(3)") == (3, "before\n", "")
        assert k.run("raise SystemExit(0)") == (0, "", "")
        assert k.run("sys.exit()") == (0, "", "")
        assert k.run("sys.exit(True)") == (1, "", "")
        assert k.run("sys.exit(-1)") == (255, "", "")
        assert k.run("sys.exit('bye')") == (1, "", "bye\n")
        assert k.run("exit(4)") == (4, "", "")  # site's exit() also closes sys.stdin
        code, out, err = k.run("input()")
        assert code == 1 and "EOFError" in err, err  # stdin is back (at EOF, like /dev/null)
        assert_ok(k.run("print('alive')"), "alive\n")


def test_output_is_flushed_before_done():
    with Kernel() as k:
        code, out, err = k.run(
            "import sys\nsys.stdout.write('no newline')\nsys.stderr.write('err no newline')\n"
            "print('x' * 100000, end='')"
        )
        assert code == 0
        assert out == "no newline" + "x" * 100000
        assert err == "err no newline"


def test_output_streams_while_running():
    with Kernel() as k:
        req_id = k.send("import time\nprint('first')\ntime.sleep(1)\nprint('second')")
        deadline = time.monotonic() + 0.8
        while b"first\n" not in k.bufs["stdout"] and time.monotonic() < deadline:
            k._pump(0.05)
        assert bytes(k.bufs["stdout"]) == b"first\n"  # line by line, not at the end
        assert k.event() == {"event": "done", "id": req_id, "exit_code": 0}
        assert k.take_output() == ("first\nsecond\n", "")


def test_unicode_and_recursion():
    with Kernel() as k:
        assert_ok(k.run("print('h\u00e9llo \u2713')\n'\u00e9'"), "h\u00e9llo \u2713\n'\u00e9'\n")
        # raw UTF-8 in the request line, as serde_json writes it
        req_id = k.send("print('\u00e9\u2713 \U0001f600', 'a\\tb')", ensure_ascii=False)
        assert k.event() == {"event": "done", "id": req_id, "exit_code": 0}
        assert k.take_output() == ("\u00e9\u2713 \U0001f600 a\tb\n", "")
        code, out, err = k.run("def f():\n    return f()\nf()")
        assert code == 1 and "RecursionError" in err and "kernel.py" not in err, err
        assert_ok(k.run("1"), "1\n")


def test_subprocess_output_and_fds():
    with Kernel() as k:
        code, out, err = k.run(
            "import subprocess, sys\n"
            "subprocess.run(['echo', 'from child'])\n"
            "subprocess.run([sys.executable, '-c', "
            "'import os; print(sorted(int(f) for f in os.listdir(\"/proc/self/fd\")))'])\n"
            "import os\n"
            "rc = os.system('echo from shell >&2')\n"
        )
        assert code == 0, err
        # the child sees stdin/stdout/stderr and the fd listdir() opened, none of the pipes
        assert out == "from child\n[0, 1, 2, 3]\n", out
        assert err == "from shell\n"


# -- top-level await -----------------------------------------------------------------------------


def test_top_level_await():
    with Kernel() as k:
        assert_ok(k.run("import asyncio\nawait asyncio.sleep(0.01)\nprint('slept')"), "slept\n")
        assert_ok(k.run("await asyncio.sleep(0, result=7)"), "7\n")
        assert_ok(k.run("async def twice(v):\n    await asyncio.sleep(0)\n    return 2 * v\n"), "")
        assert_ok(k.run("[await twice(i) for i in range(3)]"), "[0, 2, 4]\n")
        assert_ok(k.run("r = await asyncio.gather(twice(1), twice(2))\nr"), "[2, 4]\n")
        # a plain cell may still start its own loop
        assert_ok(k.run("asyncio.run(twice(5))"), "10\n")
        # one loop for all cells, like a notebook
        assert_ok(
            k.run("async def cur():\n    return asyncio.get_running_loop()\nl1 = await cur()"),
            "",
        )
        assert_ok(k.run("l2 = await cur()\nprint(l1 is l2)"), "True\n")
        code, out, err = k.run("async def bad():\n    raise ValueError('async')\nawait bad()")
        assert code == 1
        assert "ValueError: async" in err and "<cell-" in err, err
        assert "kernel.py" not in err and "asyncio" not in err, err


# -- argv, cwd, sys.path -----------------------------------------------------------------------


def test_argv_cwd_and_path():
    with Kernel() as k:
        assert_ok(k.run("import sys\nsys.argv", args=["a", "b c"]), "['main.py', 'a', 'b c']\n")
        assert_ok(k.run("sys.argv"), "['main.py']\n")
        assert_ok(k.run("import os\nos.chdir('/')\nos.getcwd()"), "'/'\n")
        code, out, err = k.run("os.getcwd() == %r and sys.path[0] == %r" % (k.workdir, k.workdir))
        assert (code, out) == (0, "True\n"), (out, err)
        # a module written into the workspace is importable right away
        assert_ok(k.run("open('mymod.py', 'w').write('V = 5\\n')\nimport mymod\nmymod.V"), "5\n")
        assert k.run("open('mymod2.py', 'w').write('V = 6\\n')")[0] == 0
        assert_ok(k.run("import mymod2\nmymod2.V"), "6\n")
        code, out, err = k.run("import kernel")
        assert code == 1 and "ModuleNotFoundError" in err, err  # the kernel's dir is not on sys.path


# -- interrupts ---------------------------------------------------------------------------------


def _interrupt_after(k, code, delay=0.3):
    req_id = k.send(code)
    time.sleep(delay)
    k.interrupt()
    ev = k.event(timeout=5)
    assert ev == {"event": "done", "id": req_id, "exit_code": 1}, ev
    return k.take_output()


def test_sigint_busy_loop():
    with Kernel() as k:
        out, err = _interrupt_after(k, "print('start')\nwhile True:\n    pass\n")
        assert out == "start\n"
        assert err.startswith("Traceback") and err.rstrip().endswith("KeyboardInterrupt"), err
        assert "<cell-1>" in err and "kernel.py" not in err, err
        assert_ok(k.run("print('alive')"), "alive\n")


def test_sigint_sleep_and_await():
    with Kernel() as k:
        out, err = _interrupt_after(k, "import time\ntime.sleep(100)")
        assert "KeyboardInterrupt" in err and "kernel.py" not in err, err
        out, err = _interrupt_after(k, "import asyncio\nawait asyncio.sleep(100)")
        assert "KeyboardInterrupt" in err and "kernel.py" not in err, err
        # the interrupted cell does not resume, and the loop still works
        assert_ok(k.run("await asyncio.sleep(0.01)\nprint('ok')"), "ok\n")
        out, err = _interrupt_after(k, "await asyncio.sleep(0)\nwhile True:\n    pass\n")
        assert "KeyboardInterrupt" in err and "kernel.py" not in err, err
        assert_ok(k.run("await asyncio.sleep(0, result='ok')"), "'ok'\n")


def test_sigint_between_execs_is_ignored():
    with Kernel() as k:
        assert_ok(k.run("x = 1"), "")
        k.interrupt()
        time.sleep(0.2)
        assert k.proc.poll() is None
        assert_ok(k.run("x"), "1\n")


def test_user_sigint_handler_and_keyboardinterrupt_catch():
    with Kernel() as k:
        out, err = _interrupt_after(
            k, "import time\ntry:\n    time.sleep(100)\nexcept KeyboardInterrupt:\n    print('caught')\n    raise\n"
        )
        assert out == "caught\n"


# -- user code that breaks things ---------------------------------------------------------------


def test_user_closes_channel_fds():
    with Kernel() as k:
        code, out, err = k.run("import os\nfor fd in (3, 4):\n    try:\n        os.close(fd)\n    except OSError:\n        pass\n")
        assert code == 0, err
        assert_ok(k.run("print('still here')"), "still here\n")
        # fds 3 and 4 are free for user code
        assert_ok(k.run("f = open('a.txt', 'w')\nf.fileno() <= 4"), "True\n")


def test_user_breaks_stdout():
    with Kernel() as k:
        assert k.run("import sys\nsys.stdout.close()")[0] == 0
        assert_ok(k.run("print('reopened')"), "reopened\n")
        assert k.run("import io\nsys.stdout = io.StringIO()\nprint('lost')")[0] == 0
        assert_ok(k.run("print('restored')"), "restored\n")
        assert k.run("import os\nos.close(1)")[0] == 0
        assert_ok(k.run("print('fd 1 back')\nos.system('echo shell too')"), "fd 1 back\nshell too\n0\n")
        assert k.run("f = open('x.txt', 'w')\nos.dup2(f.fileno(), 1)")[0] == 0
        assert_ok(k.run("print('not in the file')"), "not in the file\n")
        assert k.run("sys.stderr.close()")[0] == 0
        code, out, err = k.run("1/0")
        assert code == 1 and "ZeroDivisionError" in err


def test_fork_child_does_not_answer():
    with Kernel() as k:
        code, out, err = k.run(
            "import os\npid = os.fork()\n"
            "if pid == 0:\n    print('child')\nelse:\n    os.waitpid(pid, 0)\n    print('parent')\n"
        )
        assert code == 0
        assert sorted(out.split()) == ["child", "parent"], out
        assert k.event(timeout=0.3) is None  # exactly one done
        assert_ok(k.run("print('next')"), "next\n")


def test_output_of_a_cell_that_breaks_stdout_stays_in_that_cell():
    _broken_stdout_cells(Kernel(), lost=False)
    # unbuffered (python3 -u), the text a failed write could not pass on is dropped
    _broken_stdout_cells(Kernel(env={"PYTHONUNBUFFERED": "1"}), lost=True)


def _broken_stdout_cells(k, lost):
    with k:
        # print() after os.close(1) only buffers its line (the write, and its EBADF, come at
        # a flush): the line comes out in this cell (the fd is repaired before `done`), or,
        # unbuffered, not at all; never in the next
        code, out, err = k.run("import os\nos.close(1)\nprint('x')")
        assert (code, out) == (0, "" if lost else "x\n"), (code, out, err)
        assert k.run("print('next')") == (0, "next\n", "")

        # unflushed output, then fd 1 closed, then an exception
        code, out, err = k.run("import sys\nsys.stdout.write('partial')\nos.close(1)\nraise ValueError('v')")
        assert (code, out) == (1, "" if lost else "partial"), (code, out, err)
        assert err.count("Traceback") == 1 and "ValueError: v" in err, err
        assert k.run("print('next')") == (0, "next\n", "")

        # stderr closed: the traceback (written once) is this cell's
        code, out, err = k.run("print('out')\nos.close(2)\n1 / 0")
        assert (code, out) == (1, "out\n"), (code, out, err)
        assert err.count("Traceback") == 1 and "ZeroDivisionError" in err, err
        assert k.run("print('next')") == (0, "next\n", "")

        # both closed, and a SystemExit message ('o' went out when 'e' was written: stdout is
        # flushed before anything goes to stderr)
        code, out, err = k.run("sys.stdout.write('o')\nsys.stderr.write('e')\nos.close(1)\nos.close(2)\nsys.exit('bye')")
        assert (code, out, err) == (1, "o", "bye\n" if lost else "ebye\n"), (code, out, err)
        assert k.run("print('next')") == (0, "next\n", "")

        # sys.stdout and sys.stderr replaced: the traceback still reaches the runner
        code, out, err = k.run("import io\nsys.stdout = sys.stderr = io.StringIO()\nprint('lost')\n1 / 0")
        assert code == 1 and out == "" and "ZeroDivisionError" in err, (code, out, err)
        assert k.run("print('next')") == (0, "next\n", "")

        # what a cell wrote while fd 1 was a file of its own goes to that file, not the runner
        code, out, err = k.run("f = open('out.txt', 'w')\nos.dup2(f.fileno(), 1)\nprint('to the file', end='')")
        assert (code, out) == (0, ""), (code, out, err)
        with open(os.path.join(k.workdir, "out.txt")) as f:
            assert f.read() == "to the file"
        assert k.run("print('next')") == (0, "next\n", "")


# -- children ----------------------------------------------------------------------------------


def _children(pid):
    """{pid: state letter} of pid's children, from /proc."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found[int(name)] = fields[0]
    return found


def _kill_leftovers(k):
    """What the runner does after each exec: SIGKILL every live process the kernel started."""
    killed = []
    for pid, state in _children(k.proc.pid).items():
        if state not in "ZX":
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


def _wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


WAIT_EXITED = """
def exited(pid):
    try:
        with open('/proc/%d/stat' % pid) as f:
            return f.read().rsplit(')', 1)[1].split()[0] in 'ZX'
    except OSError:
        return True  # reaped already
deadline = time.monotonic() + 10
while not all(map(exited, pids)) and time.monotonic() < deadline:
    time.sleep(0.01)
print(all(map(exited, pids)))
"""


def test_exited_children_are_reaped_before_done():
    with Kernel() as k:
        code, out, err = k.run(
            "import os, subprocess, time\n"
            "pids = []\n"
            "for _ in range(5):\n"
            "    pid = os.fork()\n"
            "    if pid == 0:\n"
            "        os._exit(0)\n"
            "    pids.append(pid)\n"
            "pids.append(subprocess.Popen(['true']).pid)  # the Popen is dropped\n"
            + WAIT_EXITED
        )
        assert (code, out) == (0, "True\n"), (code, out, err)
        assert _children(k.proc.pid) == {}  # reaped before `done`, no waiting
        assert_ok(k.run("print('next')"), "next\n")


def test_children_killed_after_done_are_reaped_while_idle():
    with Kernel() as k:
        code, out, err = k.run(
            "import os, subprocess\n"
            "for _ in range(20):\n"
            "    if os.fork() == 0:\n"
            "        os.execvp('sleep', ['sleep', '100'])\n"
            "subprocess.Popen(['sleep', '100']);\n"
        )
        assert code == 0, err
        assert len(_kill_leftovers(k)) == 21
        # no next request needed: SIGCHLD while idle reaps them
        assert _wait_until(lambda: _children(k.proc.pid) == {}), _children(k.proc.pid)
        assert_ok(k.run("print('next')"), "next\n")

        # a cell's own SIGCHLD disposition is given back to the next cell
        assert_ok(k.run("import signal\nsignal.signal(signal.SIGCHLD, lambda s, f: None)\nprint('set')"), "set\n")
        assert_ok(k.run("signal.getsignal(signal.SIGCHLD).__name__"), "'<lambda>'\n")
        assert_ok(k.run("signal.signal(signal.SIGCHLD, signal.SIG_DFL)\nprint('reset')"), "reset\n")
        assert k.run("os.fork() or os.execvp('sleep', ['sleep', '100'])")[0] == 0
        assert len(_kill_leftovers(k)) == 1
        assert _wait_until(lambda: _children(k.proc.pid) == {}), _children(k.proc.pid)


def test_reaping_leaves_exit_statuses_to_their_owners():
    with Kernel() as k:
        code, out, err = k.run(
            "import asyncio, multiprocessing, os, subprocess, time\n"
            "p = subprocess.Popen(['sh', '-c', 'exit 3'])\n"
            "q = subprocess.Popen(['sleep', '100'])\n"
            "m = multiprocessing.get_context('fork').Process(target=time.sleep, args=(100,))\n"
            "m.start()\n"
            "a = await asyncio.create_subprocess_exec('sleep', '100')\n"
            "pids = [p.pid]\n"
            + WAIT_EXITED
            + "print(p.pid, q.pid, m.pid)\n"
        )
        assert code == 0, err
        done, p, q, m = out.split()
        assert done == "True", out
        p, q, m = int(p), int(q), int(m)
        assert len(_kill_leftovers(k)) == 3  # q, m, a
        # multiprocessing's child is reaped (by multiprocessing, which keeps its exitcode);
        # the Popens' children are left to the Popens
        assert _wait_until(lambda: m not in _children(k.proc.pid)), _children(k.proc.pid)
        time.sleep(0.2)
        children = _children(k.proc.pid)
        assert children.get(p) == "Z" and children.get(q) == "Z", children
        code, out, err = k.run("print(p.wait(), q.wait(), m.exitcode, await a.wait())")
        assert (code, out, err) == (0, "3 -9 -9 -9\n", ""), (code, out, err)
        assert _children(k.proc.pid) == {}


# -- tools ------------------------------------------------------------------------------------


ADD = {
    "name": "add",
    "description": "Adds two numbers.",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer", "description": "The first."}, "b": {"type": "number"}},
        "required": ["a", "b"],
    },
}

SEARCH = {
    "name": "web-search",
    "description": "Searches the web.\nReturns hits.",
    "parameters": {
        "type": "object",
        "properties": {
            "query": {"type": "string"},
            "class": {"type": "string"},
            "max-results": {"type": "integer"},
            "lambda": {},
            "_codebroker_call": {"type": "boolean"},
        },
        "required": ["query", "class"],
    },
}


class FakeToolSocket:
    """A tool socket like the runner's: one JSON line per connection, answered by `answer`
    once `release` allows it (so tests can see calls arrive before any is answered)."""

    def __init__(self, answer):
        import socket
        import threading

        self.dir = tempfile.mkdtemp(prefix="cb-tools-")
        self.path = os.path.join(self.dir, "tools.sock")
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(self.path)
        self.sock.listen(16)
        self.answer = answer
        self.calls = []
        self.release = threading.Event()
        self.release.set()
        self.lock = threading.Lock()
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        import threading

        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.handle, args=(conn,), daemon=True).start()

    def handle(self, conn):
        with conn:
            line = conn.makefile("rb").readline()
            req = json.loads(line)
            with self.lock:
                self.calls.append(req)
            self.release.wait(10)
            conn.sendall(json.dumps(self.answer(req)).encode() + b"\n")

    def close(self):
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _add_answer(req):
    inp = req["input"]
    if req["name"] != "add":
        return {"result": None, "is_error": True, "error_message": "Unknown tool: %r" % req["name"]}
    if inp.get("a") is None or inp.get("b") is None:
        return {"result": None, "is_error": True, "error_message": "need a and b"}
    return {"result": inp["a"] + inp["b"], "is_error": False, "error_message": None}


def test_tool_signatures_from_json_schema():
    with Kernel() as k:
        code, out, err = k.run(
            "import inspect\n"
            "print(inspect.signature(add))\n"
            "print(inspect.signature(web_search))\n"
            "print(inspect.iscoroutinefunction(add), add.__name__, add.tool_name, web_search.tool_name)\n"
            "print(add.__doc__)\n"
            "print(web_search.__doc__)\n",
            tools=[ADD, SEARCH],
        )
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0] == "(*, a: int, b: float)", out
        # keywords get `_`; non-identifiers `_`; optional ones default to None
        assert lines[1] == (
            "(*, query: str, class_: str, max_results: int | None = None, lambda_=None, "
            "_codebroker_call_: bool | None = None)"
        ), out
        assert lines[2] == "True add add web-search", out
        assert "\n".join(lines[3:7]) == (
            "Adds two numbers.\n\nArgs:\n    a (int): The first."
        ), out
        assert "Searches the web.\nReturns hits.\n\nArgs:\n    query (str)\n    class_ (str)\n" in out, out
        assert "    max_results (int, optional)\n" in out, out


def test_tool_function_names():
    tools = [
        {"name": "print"},  # a builtin
        {"name": "class"},  # a keyword
        {"name": "match"},  # a soft keyword is a fine name
        {"name": "2fa"},
        {"name": "a-b"},
        {"name": "a_b"},
        {"name": "ToolError"},
        {"name": "no_schema", "parameters": {}},
        {"name": "closed", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
        {"name": "open_ended", "parameters": {"properties": {"x": {}}, "additionalProperties": True}},
        {"name": "kw", "parameters": {"properties": {"kwargs": {}}, "additionalProperties": {}}},
    ]
    with Kernel() as k:
        code, out, err = k.run(
            "import inspect\n"
            "for f in (print_tool, class_tool, match, _2fa, a_b, a_b_2, ToolError_tool, no_schema, closed, open_ended, kw):\n"
            "    print(f.__name__, f.tool_name, inspect.signature(f))\n"
            "print(print is __builtins__.print if isinstance(__builtins__, type(inspect)) else print is __builtins__['print'])",
            tools=tools,
        )
        assert code == 0, err
        assert out.splitlines() == [
            "print_tool print (**kwargs)",
            "class_tool class (**kwargs)",
            "match match (**kwargs)",
            "_2fa 2fa (**kwargs)",
            "a_b a-b (**kwargs)",
            "a_b_2 a_b (**kwargs)",
            "ToolError_tool ToolError (**kwargs)",
            "no_schema no_schema (**kwargs)",
            "closed closed ()",
            "open_ended open_ended (*, x=None, **kwargs)",
            "kw kw (*, kwargs=None, **kwargs_2)",
            "True",
        ], out


def test_tool_calls_over_the_socket():
    server = FakeToolSocket(_add_answer)
    try:
        with Kernel() as k:
            req = dict(tools=[ADD, {"name": "opt", "parameters": {"properties": {"x": {}, "y": {}}, "required": ["x"]}}],
                       tool_socket=server.path)
            code, out, err = k.run(
                "import os, numpy\n"
                "print(await add(a=1, b=2))\n"
                "try:\n    await add(a=1, b=None)\nexcept ToolError as e:\n    print('caught', e, e.tool)\n"
                "try:\n    await opt(x=None)\nexcept ToolError as e:\n    print('caught', e)\n"
                "try:\n    add(1, 2)\nexcept TypeError as e:\n    print('TypeError', e)\n"
                "print(os.environ['CODEBROKER_TOOL_SOCKET'] == %r)\n" % server.path,
                **req,
            )
            assert code == 0, err
            assert out.splitlines() == [
                "3",
                "caught need a and b add",
                "caught Unknown tool: 'opt'",
                "TypeError add() takes 0 positional arguments but 2 were given",
                "True",
            ], (out, err)
            # required None is sent as null, optional None is left out
            assert server.calls[1] == {"name": "add", "input": {"a": 1, "b": None}}, server.calls
            assert server.calls[2] == {"name": "opt", "input": {"x": None}}, server.calls

            # gather: both calls reach the socket before either is answered
            server.calls.clear()
            server.release.clear()
            import threading

            def release_when_both_arrived():
                deadline = time.monotonic() + 10
                while len(server.calls) < 2 and time.monotonic() < deadline:
                    time.sleep(0.005)
                server.both = len(server.calls) == 2
                server.release.set()

            threading.Thread(target=release_when_both_arrived, daemon=True).start()
            code, out, err = k.run(
                "import asyncio\nprint(await asyncio.gather(add(a=1, b=2), add(a=numpy.int64(3), b=numpy.float64(4))))",
                **req,
            )
            assert code == 0, err
            assert out == "[3, 7.0]\n", out
            assert server.both

            # an uncaught ToolError shows only the cell's frames
            code, out, err = k.run("await add(a=None, b=1)", **req)
            assert code == 1
            assert err.endswith("ToolError: need a and b\n"), err
            assert "kernel.py" not in err and "codebroker-tool" not in err, err
            assert "kernel_tools.py" not in err, err
            assert 'File "<cell-' in err, err
    finally:
        server.close()


def test_parts_load_on_first_use_and_stay_out_of_sight():
    # kernel_tools.py and kernel_state.py sit beside kernel.py; user code can import
    # neither, and they are not in sys.modules before or after their first use.
    server = FakeToolSocket(_add_answer)
    listed = "import sys\nprint([m for m in sys.modules if 'kernel' in m])"
    try:
        with Kernel() as k:
            assert_ok(k.run(listed), "[]\n")
            assert_ok(k.run("print(await add(a=1, b=2))", tools=[ADD], tool_socket=server.path), "3\n")
            assert_ok(k.run(listed), "[]\n")
            assert k.run("1", rich=True)[0] == 0
            assert_ok(k.run(listed), "[]\n")
            for name in ("kernel_tools", "kernel_state", "kernel_rich"):
                code, out, err = k.run("import %s" % name)
                assert code == 1 and "ModuleNotFoundError" in err, err
    finally:
        server.close()


def test_notebook_shell_lines_run_in_the_shell():
    with Kernel() as k:
        assert_ok(k.run("!echo hi from the shell"), "hi from the shell\n")
        # Indented, mixed with Python, in order with what Python printed before.
        assert_ok(
            k.run("print('first')\nif True:\n    !echo second\nx = 3\nprint(x)"),
            "first\nsecond\n3\n",
        )
        # A failing command does not fail the cell, as in Jupyter.
        assert_ok(k.run("!exit 3\nprint('after')"), "after\n")
        code, out, err = k.run("%pip --version")
        assert code == 0 and out.startswith("pip "), (code, out, err)
        # Valid Python never changes meaning, and a real syntax error stays one.
        assert_ok(
            k.run("print(1 != 2)\ns = \"\"\"\n!not a command\n\"\"\"\nprint(s.strip())"),
            "True\n!not a command\n",
        )
        code, out, err = k.run("def (:\n!echo no")
        assert code == 1 and "SyntaxError" in err and out == "", (code, out, err)


def test_tools_do_not_linger():
    with Kernel() as k:
        assert_ok(k.run("print(add.__name__)", tools=[ADD]), "add\n")
        assert_ok(
            k.run("import os\nprint('add' in globals(), 'ToolError' in globals(), os.environ.get('CODEBROKER_TOOL_SOCKET'))"),
            "False False None\n",
        )
        # a name the code rebinds is the code's
        assert_ok(k.run("keep = add\nadd = 5", tools=[ADD], tool_socket="/nonexistent/s"), "")
        assert_ok(k.run("print(add, 'ToolError' in globals())"), "5 False\n")
        # a kept reference fails cleanly once its exec is over
        code, out, err = k.run(
            "try:\n    await keep(a=1, b=2)\nexcept Exception as e:\n    print(type(e).__name__, e)"
        )
        assert code == 0, err
        assert out.startswith("ToolError Tool 'add' is not available (tools only work during the exec"), out
        # without a socket the functions exist and raise ToolError
        code, out, err = k.run("await add(a=1, b=2)", tools=[ADD])
        assert code == 1 and "ToolError: Tool 'add' is not available: this exec has no tool socket" in err, err
        # malformed tool specs are skipped, not fatal
        assert_ok(k.run("print(add.__name__)", tools=[ADD, {"name": 5}, "x", {"description": "no name"}]), "add\n")


def test_projections_and_network_errors_load_when_asked_for():
    # The image's lazy-imports.py: pyplot registers the 3-D and geographic projections by
    # name and imports them with the first figure that asks; pandas' test helpers import
    # socket when they make their tuple of network errors.
    if not (_has("pandas") and _has("matplotlib")):
        skip("needs pandas and matplotlib")
    with Kernel() as k:
        code, out, err = k.run(
            "import sys, pandas as pd, matplotlib\n"
            "matplotlib.use('Agg')\n"
            "import matplotlib.pyplot as plt, matplotlib.projections as proj\n"
            "print('mpl_toolkits.mplot3d' in sys.modules, 'socket' in sys.modules)\n"
            "print({'3d', 'mollweide', 'polar'} <= set(proj.get_projection_names()))\n"
            "fig = plt.figure()\n"
            "ax = fig.add_subplot(1, 2, 1, projection='3d')\n"
            "ax.plot([0, 1], [0, 1], [0, 1])\n"
            "geo = fig.add_subplot(1, 2, 2, projection='mollweide')\n"
            "print(type(ax).__name__, type(geo).__name__, proj.Axes3D.__name__)\n"
            "print(proj.geo.AitoffAxes.name, 'Axes3D' in dir(proj), 'HammerAxes' in dir(proj))\n"
            "fig.savefig('p3d.png')\n"
            "from pandas._testing._io import _get_default_network_errors\n"
            "errors = _get_default_network_errors()\n"
            "print(sys.modules['socket'].timeout in errors)\n"
        )
        assert code == 0, err
        if out.startswith("True"):
            skip("this matplotlib imports mplot3d itself (not the image's)")
        assert out == (
            "False False\n"
            "True\n"
            "Axes3DSubplot MollweideAxesSubplot Axes3D\n"
            "aitoff True True\n"
            "True\n"
        ), out


def test_pandas_loads_pyarrow_when_used():
    # The image's lazy-imports.py: pandas imports without pyarrow, which loads with the
    # first Arrow-backed array; what pandas does with it is unchanged.
    if not (_has("pandas") and _has("pyarrow")):
        skip("needs pandas and pyarrow")
    with Kernel() as k:
        code, out, err = k.run(
            "import sys, pandas as pd\n"
            "print('pyarrow' in sys.modules)\n"
            "s = pd.Series(['a', None], dtype='string[pyarrow]')\n"
            "print('pyarrow' in sys.modules, type(s.array).__name__, s.str.upper().tolist())\n"
            "print(pd.Series([1, 2], dtype='int64[pyarrow]').sum())\n"
            "print(pd.arrays.ArrowExtensionArray.__name__, 'ArrowStringArray' in dir(pd.arrays))\n"
            "pd.DataFrame({'x': [1, 2]}).to_parquet('t.parquet')\n"
            "print(pd.read_parquet('t.parquet')['x'].tolist())\n"
            "import pytz\n"
            "print(len(pytz.all_timezones) > 400, 'Europe/Paris' in pytz.common_timezones_set)\n"
        )
        assert code == 0, err
        lines = out.splitlines()
        if lines[0] == "True":
            skip("this pandas imports pyarrow itself (not the image's)")
        assert out == (
            "False\n"
            "True ArrowStringArray ['A', <NA>]\n"
            "3\n"
            "ArrowExtensionArray True\n"
            "[1, 2]\n"
            "True True\n"
        ), out


# -- matplotlib -------------------------------------------------------------------------------


def test_artist_set_docs_are_made_when_asked_for():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        skip("matplotlib is not installed")
    with Kernel(mpl_cache=_build_mpl_cache()) as k:
        code, out, err = k.run(
            "import inspect, matplotlib.pyplot as plt\n"
            "from matplotlib.lines import Line2D\n"
            "from matplotlib.patches import Rectangle\n"
            "print(type(Line2D.__dict__['set']).__name__, Line2D.set._made)\n"
            "line, = plt.plot([1, 2])\n"
            "line.set(color='red', linewidth=3)\n"
            "print(line.get_color(), line.get_linewidth(), Line2D.set._made)\n"
            "sig = inspect.signature(Line2D.set)\n"
            "print('color' in sig.parameters, 'linewidth' in sig.parameters)\n"
            "print('markersize' in Line2D.set.__doc__, Line2D.set.__qualname__)\n"
            "print('color' in inspect.signature(line.set).parameters)\n"
            "print('width' in inspect.signature(Rectangle.set).parameters)\n"
            "class Mine(Rectangle):\n"
            "    def set_shade(self, v):\n"
            "        self.shade = v\n"
            "m = Mine((0, 0), 1, 1)\n"
            "m.set(shade=0.5, width=2)\n"
            "print(m.shade, m.get_width(), 'shade' in inspect.signature(Mine.set).parameters)\n"
            "try:\n"
            "    line.set(nonsense=1)\n"
            "except AttributeError as e:\n"
            "    print('refused', 'nonsense' in str(e))\n"
        )
        assert code == 0, err
        assert out == (
            "LazyArtistSet False\n"
            "red 3.0 False\n"
            "True True\n"
            "True Line2D.set\n"
            "True\n"
            "True\n"
            "0.5 2 True\n"
            "refused True\n"
        ), out


def test_plt_show_saves_plots():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        skip("matplotlib is not installed")
    with Kernel(mpl_cache=_build_mpl_cache()) as k:
        assert_ok(k.run("import sys\n'matplotlib' in sys.modules"), "False\n")
        code, out, err = k.run(
            "import matplotlib.pyplot as plt\n"
            "plt.plot([1, 2, 3], [4, 1, 9])\n"
            "plt.show()\n"
            "print(plt.get_fignums(), plt.get_backend())"
        )
        assert code == 0, err
        assert out in ("[] agg\n", "[] Agg\n"), out
        assert os.listdir(k.workdir) == ["plot-1.png"]
        assert k.displays == [{"event": "display", "id": 2, "mime": "image/png", "name": "plot-1.png"}], k.displays
        with open(os.path.join(k.workdir, "plot-1.png"), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        # the font cache was copied, not rebuilt
        assert any(n.startswith("fontlist") for n in os.listdir(k.mplconfig)), os.listdir(k.mplconfig)

        # two figures in one show(); a taken name is skipped; `from ... import show` too
        open(os.path.join(k.workdir, "plot-3.png"), "w").close()
        code, out, err = k.run(
            "from matplotlib.pyplot import show\n"
            "import matplotlib\n"
            "matplotlib.use('Agg')\n"
            "plt.figure(); plt.plot([1, 2])\n"
            "plt.figure(); plt.bar([1, 2], [3, 4])\n"
            "show()\n"
        )
        assert code == 0, err
        assert sorted(os.listdir(k.workdir)) == ["plot-1.png", "plot-2.png", "plot-3.png", "plot-4.png"]
        assert [d["name"] for d in k.displays[1:]] == ["plot-2.png", "plot-4.png"], k.displays
        assert os.path.getsize(os.path.join(k.workdir, "plot-4.png")) > 0
        assert_ok(k.run("plt.show()\nplt.get_fignums()"), "[]\n")  # nothing open, nothing saved
        assert len(os.listdir(k.workdir)) == 4


# -- output buffering ---------------------------------------------------------------------------

# Flushes on the timer only once a minute: what reaches the pipe came from another flush.
NO_TICK = {"CODEBROKER_OUTPUT_FLUSH_MS": "60000"}


def _write_syscalls(pid):
    with open("/proc/%d/io" % pid) as f:
        return int(next(line for line in f if line.startswith("syscw:")).split()[1])


def test_a_print_loop_is_a_handful_of_writes():
    with Kernel() as k:
        assert_ok(k.run("1"), "1\n")  # the ticker is started
        before = _write_syscalls(k.proc.pid)
        started = time.monotonic()
        code, out, err = k.run("for i in range(10000):\n    print(i)")
        took = time.monotonic() - started
        writes = _write_syscalls(k.proc.pid) - before
        assert (code, err) == (0, ""), err
        assert out == "".join("%d\n" % i for i in range(10000))
        # A write per 8 KiB (49 KB here) or per 10 ms tick, not per print (10,000): on a
        # loaded host the loop takes longer and the ticker writes more often.
        assert writes < 100 + took / 0.010, (writes, took)


def test_stdout_and_stderr_keep_their_order():
    with Kernel(env=NO_TICK, merged=True) as k:
        code, out, _ = k.run(
            "import sys, warnings, logging\n"
            "print('o1')\nsys.stderr.write('e1\\n')\nprint('o2')\nprint('e2', file=sys.stderr)\n"
            "print('o3')\nwarnings.warn('w1')\nprint('o4')\nlogging.error('l1')\nprint('o5')\n"
        )
        assert code == 0
        lines = [l for l in out.splitlines() if not l.startswith("  ")]
        assert lines == [
            "o1", "e1", "o2", "e2", "o3", "<cell-1>:7: UserWarning: w1", "o4", "ERROR:root:l1", "o5"
        ], out
        # the traceback comes after what the cell printed before it
        code, out, _ = k.run("print('before')\n1 / 0")
        assert code == 1 and out.startswith("before\nTraceback"), out
        # the code's own text wrapper over the kernel's stdout (to change its encoding, say)
        code, out, _ = k.run(
            "import io\nsys.stdout = io.TextIOWrapper(sys.stdout.buffer, encoding='utf-8')\n"
            "print('a')\nsys.stderr.write('b\\n')\nprint('c')"
        )
        assert (code, out) == (0, "a\nb\nc\n"), out
        # threads: every word (print() is not atomic between threads, with or without buffers)
        code, out, _ = k.run(
            "import threading\n"
            "def w(n):\n    for i in range(500):\n        print(n, i)\n"
            "ts = [threading.Thread(target=w, args=(n,)) for n in range(4)]\n"
            "for t in ts: t.start()\n"
            "for t in ts: t.join()"
        )
        assert code == 0
        words = sorted(w for n in range(4) for i in range(500) for w in (str(n), str(i)))
        assert sorted(out.split()) == words


def test_output_is_flushed_before_a_new_process():
    with Kernel(env=NO_TICK, merged=True) as k:
        code, out, err = k.run(
            "import os, subprocess, sys\n"
            "print('1')\nsubprocess.run(['echo', '2'])\nprint('3')\nos.system('echo 4')\n"
            "print('5')\nsubprocess.run([sys.executable, '-c', 'print(6)'])\n"
            "print('7')\npid = os.fork()\n"
            "if pid == 0:\n    print('8')\n    os._exit(0)\n"
            "os.waitpid(pid, 0)\nprint('9')"
        )
        assert code == 0, out
        # nothing the kernel buffered is written twice by the forked child
        assert out.split() == [str(i) for i in range(1, 10)], out


def test_output_is_flushed_before_a_tool_call():
    seen = []

    def answer(req):
        # The kernel waits for this answer: "before" must be in the pipe already.
        deadline = time.monotonic() + 2
        while b"before\n" not in k.bufs["stdout"] and time.monotonic() < deadline:
            time.sleep(0.01)
        seen.append(bytes(k.bufs["stdout"]))
        return _add_answer(req)

    server = FakeToolSocket(answer)
    try:
        with Kernel(env=NO_TICK) as k:
            code, out, err = k.run(
                "print('before')\nprint(await add(a=1, b=2))", tools=[ADD], tool_socket=server.path
            )
            assert (code, out) == (0, "before\n3\n"), (out, err)
            assert seen == [b"before\n"], seen
    finally:
        server.close()


def test_a_line_then_silence_streams_while_the_cell_runs():
    with Kernel() as k:
        k.send("import time\nprint('first')\ntime.sleep(1)\nprint('second')")
        sent = time.monotonic()
        while b"first\n" not in k.bufs["stdout"] and time.monotonic() < sent + 0.9:
            k._pump(0.005)
        arrived = time.monotonic() - sent
        assert bytes(k.bufs["stdout"]) == b"first\n"
        print("a line then sleep(1): in the pipe after %.1f ms" % (arrived * 1000))
        assert k.event()["exit_code"] == 0
        assert k.take_output() == ("first\nsecond\n", "")
        # a thread of the cell that prints on is flushed by the ticker too
        k.send(
            "import threading\n"
            "def late():\n    time.sleep(0.2)\n    print('from the thread')\n    time.sleep(0.6)\n"
            "t = threading.Thread(target=late)\nt.start()\nt.join()"
        )
        deadline = time.monotonic() + 0.7
        while b"thread" not in k.bufs["stdout"] and time.monotonic() < deadline:
            k._pump(0.01)
        assert bytes(k.bufs["stdout"]) == b"from the thread\n"
        assert k.event()["exit_code"] == 0
        k.take_output()


def test_between_cells_stdout_is_line_buffered():
    with Kernel(env=NO_TICK) as k:
        # a thread that prints after its cell ended: the line goes out when it is printed,
        # not with the next cell's output
        assert_ok(
            k.run(
                "import threading, time\n"
                "threading.Thread(target=lambda: (time.sleep(0.2), print('idle'))).start()"
            ),
            "",
        )
        deadline = time.monotonic() + 2
        while b"idle" not in k.bufs["stdout"] and time.monotonic() < deadline:
            k._pump(0.01)
        assert bytes(k.bufs["stdout"]) == b"idle\n"
        k.take_output()
        assert_ok(k.run("print('next')"), "next\n")


def test_input_and_printf_still_flush():
    with Kernel(env=NO_TICK, merged=True) as k:
        # stdin is /dev/null: input() writes its prompt after what was printed, then fails
        code, out, _ = k.run("print('before')\ninput('prompt> ')")
        assert code == 1 and out.startswith("before\nprompt> Traceback") and "EOFError" in out, out
        # C stdio is flushed at the end of the cell, after Python's buffers
        code, out, _ = k.run(
            "import ctypes\nlibc = ctypes.CDLL(None)\nlibc.printf(b'from C\\n')\nprint('from Python')"
        )
        assert (code, out) == (0, "from Python\nfrom C\n"), out


# -- preload ------------------------------------------------------------------------------------


def _has(module):
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def _wait_for_preload(k, timeout=60):
    """Waits, sending nothing (a request would stop it), for the `preloaded` event; the
    event says whether the preload was stopped."""
    deadline = time.monotonic() + timeout
    while not k.preloaded and time.monotonic() < deadline:
        assert k.event(timeout=0.2) is None, "only log and preloaded events while idle"
    assert k.preloaded, "the preload did not end within %ss" % timeout
    assert len(k.preloaded) == 1, k.preloaded
    return k.preloaded[0]["stopped"]


# What a session could see of the data stack's state, printed to compare a preloaded kernel
# with a fresh one that imports the same modules itself.
_STATE = (
    "import os, sys, matplotlib, matplotlib.pyplot as plt, matplotlib.units, pandas as pd\n"
    "print(plt.get_fignums())\n"
    "print(sorted((k, repr(v)) for k, v in matplotlib.rcParams.items()))\n"
    "print(sorted(repr(k) for k in matplotlib.units.registry))\n"
    "print(sorted((k, repr(pd.get_option(k))) for k in pd._config.config._registered_options))\n"
    "print(plt.figure().number)\n"
)


def test_preload_leaves_no_state_a_session_could_see():
    if not (_has("pandas") and _has("matplotlib")):
        skip("needs pandas and matplotlib")
    cache = _build_mpl_cache()
    with Kernel(mpl_cache=cache) as k:
        k.preload(["numpy", "pandas", "matplotlib.pyplot"])
        assert _wait_for_preload(k) is False
        code, out, err = k.run("import sys\nprint(sorted(m for m in ('numpy', 'pandas', 'matplotlib.pyplot') if m in sys.modules))")
        assert_ok((code, out, err), "['matplotlib.pyplot', 'numpy', 'pandas']\n")
        # The collector is back on, and what the preload loaded is frozen out of its walks.
        assert_ok(k.run("import gc\nprint(gc.isenabled(), gc.get_freeze_count() > 10000)"),
                  "True True\n")
        code, preloaded, err = k.run(_STATE)
        assert code == 0, err
        assert k.logs == [], k.logs
    with Kernel(mpl_cache=cache) as k:
        code, fresh, err = k.run(_STATE)
        assert code == 0, err
    assert preloaded.splitlines()[0] == "[]", preloaded
    assert preloaded.splitlines()[-1] == "1", preloaded
    for name, a, b in zip(("figures", "rcParams", "units", "pandas options", "figure number"),
                          preloaded.splitlines(), fresh.splitlines()):
        assert a == b, "%s differ:\n%s\n%s" % (name, a, b)


def test_preload_names_that_fail_are_logged_and_skipped():
    with Kernel() as k:
        k.preload([" no_such_module_here ", "os; rm -rf /", "json", "", "json", " a..b ", 7])
        assert _wait_for_preload(k) is False
        assert_ok(k.run("import sys\nprint('json' in sys.modules, 'no_such_module_here' in sys.modules)"),
                  "True False\n")
        assert_ok(k.run("print(6 * 7)"), "42\n")
        # Once code ran, a preload request is ignored: no thread, no event.
        k.preload(["wave"])
        assert_ok(k.run("import sys, threading\nprint('wave' in sys.modules, threading.active_count())"),
                  "False 1\n")
        assert k.event(timeout=0.3) is None and len(k.preloaded) == 1, k.preloaded
    assert len(k.logs) == 4, k.logs
    assert any("not a module name" in m and "7" in m for m in k.logs), k.logs
    assert any("not a module name" in m and "os; rm -rf /" in m for m in k.logs), k.logs
    assert any("not a module name" in m and "a..b" in m for m in k.logs), k.logs
    assert any("cannot import no_such_module_here: ModuleNotFoundError" in m for m in k.logs), k.logs


def test_preload_stops_at_the_first_request():
    lib = tempfile.mkdtemp(prefix="cb-preload-")
    try:
        with open(os.path.join(lib, "slow_first.py"), "w") as f:
            f.write("import time\ntime.sleep(0.5)\nDONE = True\n")
        with open(os.path.join(lib, "marker_second.py"), "w") as f:
            f.write("")
        env = {"PYTHONPATH": lib}
        with Kernel(env=env) as k:
            k.preload(["slow_first", "marker_second"])
            # Sent at once: the preload is in slow_first (or about to be). An import of
            # the module being preloaded waits for it and gets it whole; the preload
            # then ends without importing marker_second.
            code, out, err = k.run(
                "import gc, sys, time\nimport slow_first\nprint(slow_first.DONE)\n"
                "print(gc.isenabled())\n"
                "time.sleep(0.3)\nprint('marker_second' in sys.modules)"
            )
            # The preload paused the collector for its import; the cell runs with it on.
            assert_ok((code, out, err), "True\nTrue\nFalse\n")
            assert _wait_for_preload(k) is True
            assert_ok(k.run("import gc, sys\nprint('marker_second' in sys.modules)\n"
                            "print(gc.isenabled())"), "False\nTrue\n")
        # The runner's stop line (an exec in another language came first) stops it too,
        # and is not answered.
        with Kernel(env=env) as k:
            k.preload(["slow_first", "marker_second"])
            os.write(k.req_w, b'{"type":"stop_preload"}\n')
            assert _wait_for_preload(k) is True
            assert_ok(k.run("import gc, sys\nprint('marker_second' in sys.modules, gc.isenabled())"),
                      "False True\n")
    finally:
        shutil.rmtree(lib, ignore_errors=True)


def test_a_cell_waits_for_the_import_under_way_so_no_module_is_half_initialized():
    # pair_a (preloaded) imports pair_b, which imports pair_a: one thread imports them in
    # order. A cell that imports pair_b while the preload is inside pair_a would make the
    # two threads wait for each other, and Python would hand one of them a half
    # initialized module (pair_b without NAME): AttributeError. The cell waits instead.
    lib = tempfile.mkdtemp(prefix="cb-preload-")
    mark = os.path.join(lib, "importing")
    try:
        with open(os.path.join(lib, "pair_a.py"), "w") as f:
            f.write(
                "import time\nopen(%r, 'w').close()\ntime.sleep(0.4)\n"
                "import pair_b\nVALUE = pair_b.NAME + '!'\n" % mark
            )
        with open(os.path.join(lib, "pair_b.py"), "w") as f:
            f.write("import pair_a\nNAME = 'b'\ndef value():\n    return pair_a.VALUE\n")
        with Kernel(env={"PYTHONPATH": lib}) as k:
            k.preload(["pair_a"])
            deadline = time.monotonic() + 10
            while not os.path.exists(mark) and time.monotonic() < deadline:
                time.sleep(0.005)
            assert os.path.exists(mark), "the preload never started pair_a"
            # The preload paused the collector inside pair_a; stopped, it froze what it
            # had imported, so this cell runs with the collector on and pays no collection
            # of everything the paused import allocated.
            assert_ok(k.run("import gc, pair_b\nprint(pair_b.value())\n"
                            "print(gc.isenabled(), gc.get_freeze_count() > 0)"), "b!\nTrue True\n")
            assert _wait_for_preload(k) is True
    finally:
        shutil.rmtree(lib, ignore_errors=True)


def test_a_cell_beside_the_import_holds_it_at_its_next_import_statement():
    # A cell beside the import under way has the GIL to itself: the preload's thread stops
    # at its next import statement until the cell ends, then finishes the import it was in.
    # Each part of the package below spins 30 ms of CPU and leaves a file behind it; taking
    # turns with the cell every 0.5 ms, several parts would end while the cell spins.
    lib = tempfile.mkdtemp(prefix="cb-preload-")
    parts = 12
    try:
        os.mkdir(os.path.join(lib, "busy_package"))
        with open(os.path.join(lib, "busy_package", "__init__.py"), "w") as f:
            f.write("".join("from . import part%d\n" % i for i in range(parts)))
        for i in range(parts):
            with open(os.path.join(lib, "busy_package", "part%d.py" % i), "w") as f:
                f.write("import time\nend = time.perf_counter() + 0.03\n"
                        "while time.perf_counter() < end:\n    pass\n"
                        "open(%r, 'w').close()\n" % os.path.join(lib, "done%d" % i))
        count = ("def parts_done():\n    n = 0\n    for i in range(%d):\n"
                 "        try:\n            open('%s/done%%d' %% i).close()\n            n += 1\n"
                 "        except OSError:\n            pass\n    return n\n" % (parts, lib))
        with Kernel(env={"PYTHONPATH": lib}) as k:
            k.preload(["busy_package"])
            deadline = time.monotonic() + 10
            while not os.path.exists(os.path.join(lib, "done0")) and time.monotonic() < deadline:
                time.sleep(0.002)
            code, out, err = k.run(count + "before = parts_done()\nx = 0\n"
                                   "for _ in range(3000000):\n    x += 1\n"
                                   "print(parts_done() - before, before < %d)" % parts)
            assert code == 0, err
            during, started_before = out.split()
            assert started_before == "True", "the import ended before the cell came: %r" % out
            assert int(during) <= 1, "%s parts were imported beside the cell" % during
            # After the cell, the thread finishes the package (the preload is stopped) and
            # the next cell finds it whole, with the usual __import__ back in place.
            assert _wait_for_preload(k) is True
            assert_ok(k.run("import builtins, sys\nprint(len([m for m in sys.modules "
                            "if m.startswith('busy_package.')]), "
                            "type(builtins.__import__).__name__)"),
                      "%d builtin_function_or_method\n" % parts)
    finally:
        shutil.rmtree(lib, ignore_errors=True)


def test_a_cell_without_imports_runs_beside_the_import_under_way():
    # `print(1)` in a session whose pooled kernel is in the middle of pandas: it starts no
    # import, so it need not wait for that one to end; the preload stops after it, as at
    # any first request. A cell that imports, or that fails (its traceback is formatted
    # with traceback and linecache), still waits.
    lib = tempfile.mkdtemp(prefix="cb-preload-")
    mark = os.path.join(lib, "importing")
    try:
        with open(os.path.join(lib, "slow_module.py"), "w") as f:
            f.write("import time\nopen(%r, 'w').close()\ntime.sleep(1.5)\nVALUE = 7\n" % mark)
        with open(os.path.join(lib, "after_slow.py"), "w") as f:
            f.write("")

        def preloading(k):
            k.preload(["slow_module", "after_slow"])
            deadline = time.monotonic() + 10
            while not os.path.exists(mark) and time.monotonic() < deadline:
                time.sleep(0.005)
            assert os.path.exists(mark), "the preload never started slow_module"
            return time.monotonic()

        with Kernel(env={"PYTHONPATH": lib}) as k:
            started = preloading(k)
            assert_ok(k.run("print(1)"), "1\n")
            took = time.monotonic() - started
            assert took < 1.0, "print(1) waited %.2f s for the import under way" % took
            # Beside the import, the cell runs with the collector on, and its cyclic garbage
            # is not frozen when the preload ends: it is collected.
            load = "__builtins__.__dict__['__im' 'port__']"  # loaded modules, not the word
            assert_ok(k.run("class Node:\n    pass\n"
                            "a, b = Node(), Node()\na.b, b.a = b, a\n"
                            "ring = %s('weakref').ref(a)\ndel a, b\n"
                            "print(%s('gc').isenabled())" % (load, load)),
                      "True\n")
            took = time.monotonic() - started
            assert took < 1.0, "the second cell waited (%.2f s)" % took
            # The preload stopped after the import under way. The GIL was handed over
            # finely while the two ran side by side; the preload's end put the interval back.
            assert _wait_for_preload(k) is True
            assert_ok(k.run("import gc, sys, slow_module\n"
                            "print(slow_module.VALUE, 'after_slow' in sys.modules, sys.getswitchinterval())\n"
                            "gc.collect()\nprint(ring() is None)"),
                      "7 False 0.005\nTrue\n")
        os.unlink(mark)
        with Kernel(env={"PYTHONPATH": lib}) as k:
            preloading(k)
            assert_ok(k.run("print(1)"), "1\n")
            # The module is still being imported: a cell that imports it stops the preload,
            # waits for that import and gets the module whole.
            assert_ok(k.run("import slow_module\nprint(slow_module.VALUE)"), "7\n")
            assert _wait_for_preload(k) is True
            assert_ok(k.run("import sys\nprint('after_slow' in sys.modules)"), "False\n")
        os.unlink(mark)
        with Kernel(env={"PYTHONPATH": lib}) as k:
            started = preloading(k)
            code, out, err = k.run("x = 1\nprint(x / 0)")
            assert code == 1 and out == "", (code, out, err)
            assert "ZeroDivisionError" in err and "print(x / 0)" in err, err
            took = time.monotonic() - started
            assert took >= 1.4, "the failed cell reported before the import ended (%.2f s)" % took
            assert_ok(k.run("print(x)"), "1\n")
    finally:
        shutil.rmtree(lib, ignore_errors=True)


def test_a_fork_waits_for_the_import_under_way():
    lib = tempfile.mkdtemp(prefix="cb-preload-")
    mark = os.path.join(lib, "importing")
    try:
        with open(os.path.join(lib, "slow_module.py"), "w") as f:
            f.write("import time\nopen(%r, 'w').close()\ntime.sleep(0.6)\nVALUE = 7\n" % mark)
        env = {"PYTHONPATH": lib}
        with Kernel(env=env) as k:
            k.preload(["slow_module"])
            # Sent once the preload is inside the import (a request sent earlier would stop
            # it before it began). The child imports the module itself: had it been forked
            # mid-import, its import lock would belong to a thread the child does not have.
            deadline = time.monotonic() + 30
            while not os.path.exists(mark) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert os.path.exists(mark), "the preload did not start the import"
            code, out, err = k.run(
                "import os, sys\n"
                "partial = 'slow_module' in sys.modules\n"
                "pid = os.fork()\n"
                "if pid == 0:\n"
                "    import slow_module\n"
                "    os._exit(slow_module.VALUE)\n"
                "_, status = os.waitpid(pid, 0)\n"
                "print(partial, os.waitstatus_to_exitcode(status))",
                timeout=20,
            )
            # The cell saw the module half-imported (the preload was in it), and the fork
            # still gave the child a whole one.
            assert_ok((code, out, err), "True 7\n")
    finally:
        shutil.rmtree(lib, ignore_errors=True)


# -- state across kernels -----------------------------------------------------------------------

STATE_CELL = """
import numpy as np, pandas as pd
import os.path as osp
from sklearn.linear_model import LinearRegression
df = pd.DataFrame({"a": range(5), "b": list("vwxyz")})
model = LinearRegression().fit(np.arange(10).reshape(-1, 1), np.arange(10) * 2.0)
arrays = {"x": np.arange(3), "y": np.ones((2, 2)), "big": np.arange(200_000)}
class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y
    def norm(self):
        return (self.x ** 2 + self.y ** 2) ** 0.5
p = Point(3, 4)
counter = 10
def bump():
    global counter
    counter += 1
    return counter
shared = [1]
alias = shared
f = open("x.txt", "w")
g = (i for i in range(3))
import threading
t = threading.Thread(target=print)
"""

STATE_CHECK = (
    "print(df.shape, round(model.predict([[20]])[0], 6), arrays['y'].sum(), arrays['big'].sum(),"
    " p.norm(), isinstance(p, Point),"
    " bump(), counter, alias is shared, pd.__name__, osp.__name__, threading.__name__)"
)


def _state_path(k):
    """Where a test's state file goes: not the workspace (the runner keeps it in /tmp)."""
    return os.path.join(tempfile.mkdtemp(prefix="cb-state-"), "state")


def _state_file(items):
    """A state file of (name, pickle bytes) items, each starting a fresh unpickler, laid out
    as kernel.py lays it out."""
    body, index, pos = bytearray(b"codebroker python state 1\n"), [], None
    for name, data in items:
        pos = len(body)
        body += data
        index.append([name, pos, len(body), True])
    at = len(body)
    body += json.dumps({"python": "3.11", "modules": {}, "items": index}).encode()
    body += at.to_bytes(8, "little") + b"CBSTATE1"
    return bytes(body)


def test_state_moves_to_a_new_kernel_without_what_cannot_outlive_it():
    try:
        import pandas, sklearn  # noqa: F401
    except ImportError:
        skip("needs pandas and scikit-learn")
    with Kernel() as a:
        path = _state_path(a)
        assert_ok(a.run(STATE_CELL), "")
        saved = a.state("save_state", path=path, max_bytes=1 << 30, timeout_ms=30000)
        assert saved["error"] is None, saved
        assert saved["modules"] == 4 and saved["saved"] == 10, saved
        assert saved["bytes"] == os.path.getsize(path), saved
        assert sorted(saved["skipped"]) == [
            ["f", "an open file"], ["g", "a generator"], ["t", "a thread"]
        ], saved
        # The kernel that saved goes on as before.
        assert_ok(a.run("print(counter, f.closed)"), "10 False\n")
        with Kernel() as b:
            restored = b.state("restore_state", path=path, max_bytes=1 << 30)
            assert restored == {"restored": 14, "failed": [], "error": None}, restored
            assert not os.path.exists(path), "the restore removes the file"
            # Functions and methods of cells see the restored namespace, shared objects
            # stay shared, modules are the imported ones.
            assert_ok(
                b.run(STATE_CHECK),
                "(5, 2) 40.0 4.0 19999900000 5.0 True 11 11 True pandas posixpath threading\n",
            )
            assert_ok(b.run("print('f' in globals(), 'g' in globals())"), "False False\n")


def test_state_save_keeps_within_its_bounds():
    with Kernel() as k:
        path = _state_path(k)
        assert_ok(k.run("big = bytes(2_000_000)\nsmall = [1, 2, 3]\nlast = 'z'"), "")
        saved = k.state("save_state", path=path, max_bytes=100_000, timeout_ms=30000)
        assert saved["saved"] == 2 and saved["error"] is None, saved
        assert saved["skipped"] == [["big", "too large: the saved state may hold 100000 bytes"]], saved
        assert os.path.getsize(path) <= 100_000
        with Kernel() as b:
            assert b.state("restore_state", path=path, max_bytes=100_000)["restored"] == 2
            assert_ok(b.run("print(small, last, 'big' in globals())"), "[1, 2, 3] z False\n")
        # Past the time bound the name being pickled and the rest are left out.
        assert_ok(k.run("huge = list(range(3_000_000))\nafter = 1"), "")
        saved = k.state("save_state", path=path, max_bytes=1 << 30, timeout_ms=1)
        late = [n for n, why in saved["skipped"] if "longer than 1 ms" in why]
        assert "huge" in late and "after" in late, saved
        # No room even for the index: refused whole.
        saved = k.state("save_state", path=path, max_bytes=10, timeout_ms=1000)
        assert "may hold only 10 bytes" in saved["error"], saved
        assert_ok(k.run("print(len(small))"), "3\n")


def test_state_names_what_cannot_be_pickled():
    with Kernel() as k:
        path = _state_path(k)
        assert_ok(k.run(
            "import _thread\n"
            "class Bad:\n"
            "    def __reduce__(self):\n"
            "        raise RuntimeError('no')\n"
            "bad = Bad()\n"
            "inside = {'lock': _thread.allocate_lock()}\n"
            "fine = 2\n"
        ), "")
        saved = k.state("save_state", path=path, max_bytes=1 << 20, timeout_ms=5000)
        why = dict(saved["skipped"])
        assert why["bad"] == "cannot be pickled: RuntimeError: no", saved
        assert why["inside"].startswith("cannot be pickled: TypeError"), saved
        assert saved["saved"] == 2 and saved["modules"] == 1, saved  # Bad, fine; _thread
        with Kernel() as b:
            assert b.state("restore_state", path=path, max_bytes=1 << 20)["restored"] == 3
            assert_ok(b.run("print(fine, Bad.__name__)"), "2 Bad\n")


def test_a_damaged_state_is_refused_and_the_kernel_goes_on():
    with Kernel() as a:
        path = _state_path(a)
        assert_ok(a.run("one = 'first'\ntwo = list(range(1000))\nthree = {'k': 3}"), "")
        assert a.state("save_state", path=path, max_bytes=1 << 20, timeout_ms=5000)["saved"] == 3
        with open(path, "rb") as f:
            good = f.read()

    def restore(data, max_bytes=1 << 20):
        with open(path, "wb") as f:
            f.write(data)
        with Kernel() as b:
            answer = b.state("restore_state", path=path, max_bytes=max_bytes)
            code, out, err = b.run("print(sorted(k for k in globals() if not k.startswith('__')))")
            assert code == 0, err
            return answer, out

    for data, error in (
        (b"", "too short"),
        (b"x" * 100, "not a saved state"),
        (good[:-3], "cut short"),
        (good[:-12] + (10 ** 9).to_bytes(8, "little") + b"CBSTATE1", "index is damaged"),
    ):
        answer, names = restore(data)
        assert error in (answer["error"] or ""), (error, answer)
        assert names == "[]\n", names
    answer, _ = restore(good, max_bytes=100)
    assert "more than the 100 allowed" in answer["error"], answer
    # One name's bytes spoiled: that name fails, the others load.
    i = good.index(b"first")
    answer, names = restore(good[:i] + b"\xff\xff\xff\xff\xff" + good[i + 5:])
    assert answer["error"] is None and answer["restored"] >= 2, answer
    assert any(n == "one" for n, _ in answer["failed"]) or "'one'" in names, answer
    assert "'three'" in names and "'two'" in names, names
    # Hostile bytes reach for no object of the kernel's but the namespace: an unknown
    # persistent id fails its name; the others load.
    import pickle

    class Other:
        pass

    class Reacher(pickle.Pickler):
        def persistent_id(self, obj):
            return "kernel" if isinstance(obj, Other) else None

    import io as _io
    reach = _io.BytesIO()
    Reacher(reach, protocol=5).dump([Other()])
    answer, names = restore(_state_file([("reach", reach.getvalue()), ("ok", pickle.dumps(7))]))
    assert answer["failed"] == [["reach", "UnpicklingError: unknown persistent id"]], answer
    assert names == "['ok']\n", names
    with Kernel() as k:
        assert_ok(k.run("x = 1"), "")
        with open(path, "wb") as f:
            f.write(good)
        answer = k.state("restore_state", path=path, max_bytes=1 << 20)
        assert answer["error"] == "the kernel has run code already", answer


def test_nothing_to_save_writes_no_file():
    with Kernel() as k:
        path = _state_path(k)
        saved = k.state("save_state", path=path, max_bytes=1 << 20, timeout_ms=1000)
        assert saved == {"bytes": 0, "saved": 0, "modules": 0, "skipped": [], "error": None}, saved
        assert not os.path.exists(path)


def test_a_restore_stops_the_preload():
    lib = tempfile.mkdtemp(prefix="cb-preload-")
    try:
        with open(os.path.join(lib, "slow_first.py"), "w") as f:
            f.write("import time\ntime.sleep(0.5)\n")
        with open(os.path.join(lib, "marker_second.py"), "w") as f:
            f.write("")
        with Kernel(env={"PYTHONPATH": lib}) as k:
            k.preload(["slow_first", "marker_second"])
            answer = k.state("restore_state", path=os.path.join(lib, "none"), max_bytes=100)
            assert "cannot open" in answer["error"], answer
            assert _wait_for_preload(k) is True
            assert_ok(k.run("import sys\nprint('marker_second' in sys.modules)"), "False\n")
    finally:
        shutil.rmtree(lib, ignore_errors=True)


# -- packages installed mid-session -----------------------------------------------------------

# What the image's ENV sets for pip (sandbox-image/Dockerfile); on a host the tests set it.
PIP_ENV = {
    "PIP_USER": "1",
    "PIP_BREAK_SYSTEM_PACKAGES": "1",
    "PIP_NO_CACHE_DIR": "1",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    "PIP_NO_WARN_SCRIPT_LOCATION": "1",
    "PIP_PROGRESS_BAR": "off",
}
IN_IMAGE = os.path.isdir("/opt/codebroker")

# Defines USER_SITE (where pip --user installs, from PYTHONUSERBASE as site computes it) and
# write_package(name, value): a package written there the way pip leaves one.
USER_SITE_CELL = (
    "import os, sys, site\n"
    "USER_SITE = os.path.join(os.environ['PYTHONUSERBASE'], 'lib',\n"
    "                         'python%d.%d' % sys.version_info[:2], 'site-packages')\n"
    "def write_package(name, value):\n"
    "    d = os.path.join(USER_SITE, name)\n"
    "    os.makedirs(d, exist_ok=True)\n"
    "    with open(os.path.join(d, '__init__.py'), 'w') as f:\n"
    "        f.write('VALUE = %r\\n' % value)\n"
    "print(USER_SITE == site.USER_SITE, os.path.isdir(USER_SITE), USER_SITE in sys.path)\n"
)


def test_a_package_installed_mid_session_imports_at_once():
    base = tempfile.mkdtemp(prefix="cb-userbase-")
    try:
        with Kernel(env={"PYTHONUSERBASE": base}) as k:
            # No user site at start: `site` left it off sys.path.
            assert_ok(k.run(USER_SITE_CELL), "True False False\n")
            # The first package creates it; the next statement of the same cell imports it,
            # and a module in a directory a .pth file there names.
            assert_ok(k.run(
                "write_package('mypkg', 'one')\n"
                "EXTRA = os.path.join(os.environ['PYTHONUSERBASE'], 'extra')\n"
                "os.makedirs(EXTRA)\n"
                "with open(os.path.join(EXTRA, 'pthmod.py'), 'w') as f:\n    f.write('X = 5\\n')\n"
                "with open(os.path.join(USER_SITE, 'extra.pth'), 'w') as f:\n    f.write(EXTRA + '\\n')\n"
                "import mypkg, pthmod\n"
                "print(mypkg.VALUE, mypkg.__file__.startswith(USER_SITE), pthmod.X)"), "one True 5\n")
            assert_ok(k.run("import mypkg\nprint(mypkg.VALUE)"), "one\n")
            # Where `site` puts them at start: before the system's site-packages, once.
            assert_ok(k.run(
                "i = sys.path.index(USER_SITE)\n"
                "print(sys.path.count(USER_SITE), sys.path.index(EXTRA) == i + 1, all(\n"
                "      sys.path.index(p) > i + 1 for p in site.getsitepackages() if p in sys.path))"),
                "1 True True\n")
            # A second package into the directory that exists now, imported in the same
            # cell, and a third imported in the next one. Its mtime tells the import system
            # to list it again; the pause stands for pip's run (seconds), longer than the
            # tick of the coarsest file timestamps, which could leave the mtime as it was.
            assert_ok(k.run("import time\ntime.sleep(0.05)\nwrite_package('mypkg2', 'two')\n"
                            "import mypkg2\nprint(mypkg2.VALUE)"), "two\n")
            assert_ok(k.run("time.sleep(0.05)\nwrite_package('mypkg3', 'three')"), "")
            assert_ok(k.run("import mypkg3\nprint(mypkg3.VALUE, sys.path.count(USER_SITE))"),
                      "three 1\n")
            # A module nobody installed is still not found, quietly.
            code, out, err = k.run("import not_installed_anywhere")
            assert code == 1 and "ModuleNotFoundError: No module named 'not_installed_anywhere'" in err, err
        # A kernel started once the user site exists has it from the start.
        with Kernel(env={"PYTHONUSERBASE": base}) as k:
            assert_ok(k.run(USER_SITE_CELL + "import mypkg\nprint(mypkg.VALUE)"), "True True True\none\n")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _wheel(directory, name, version, code):
    """A minimal pure-Python wheel: the package, METADATA, WHEEL and RECORD."""
    import base64
    import hashlib
    import zipfile

    info = "%s-%s.dist-info" % (name, version)
    files = {
        "%s/__init__.py" % name: code,
        "%s/METADATA" % info: "Metadata-Version: 2.1\nName: %s\nVersion: %s\n" % (name, version),
        "%s/WHEEL" % info: "Wheel-Version: 1.0\nGenerator: codebroker-test\nRoot-Is-Purelib: true\n"
                           "Tag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        data = text.encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append("%s,sha256=%s,%d" % (path, digest, len(data)))
    record.append("%s/RECORD,," % info)
    files["%s/RECORD" % info] = "\n".join(record) + "\n"
    path = os.path.join(directory, "%s-%s-py3-none-any.whl" % (name, version))
    with zipfile.ZipFile(path, "w") as z:
        for name_in_zip, text in files.items():
            z.writestr(name_in_zip, text)
    return path


def test_pip_installs_a_wheel_offline_into_the_user_site_and_the_kernel_imports_it():
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode:
        if IN_IMAGE:
            raise AssertionError("the image has no pip")
        skip("no pip")
    base = tempfile.mkdtemp(prefix="cb-userbase-")
    wheels = tempfile.mkdtemp(prefix="cb-wheel-")
    try:
        wheel = _wheel(wheels, "cbwheel", "1.0", "VALUE = 'from a wheel'\n")
        env = {"PYTHONUSERBASE": base}
        if not IN_IMAGE:
            env.update(PIP_ENV)
        else:  # the image's own ENV, as every sandbox gets it
            assert {k: os.environ.get(k) for k in PIP_ENV} == PIP_ENV, os.environ
        with Kernel(env=env) as k:
            code, out, err = k.run(
                "import os, subprocess, sys\n"
                "r = subprocess.run([sys.executable, '-m', 'pip', 'install', '--no-index', %r],\n"
                "                   capture_output=True, text=True)\n"
                "print(r.returncode)\n"
                "if r.returncode:\n    print(r.stdout, r.stderr)\n"
                "import cbwheel\n"
                "print(cbwheel.VALUE, cbwheel.__file__.startswith(%r))\n"
                "print(repr(r.stderr))\n" % (wheel, base),
                timeout=120,
            )
            assert code == 0 and out.splitlines()[:2] == ["0", "from a wheel True"], (code, out, err)
            if IN_IMAGE:  # no warning (bin dir, version check, externally managed) either
                assert out.splitlines()[2] == "''", out
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(wheels, ignore_errors=True)


def test_npm_installs_a_local_package_into_the_working_directory():
    if shutil.which("npm") is None:
        if IN_IMAGE:
            raise AssertionError("the image has no npm")
        skip("no npm")
    if not IN_IMAGE:
        skip("the image's npm (its wrapper and ENV) only")
    top = tempfile.mkdtemp(prefix="cb-npm-")
    try:
        pkg, work = os.path.join(top, "pkg"), os.path.join(top, "work")
        os.makedirs(pkg)
        os.makedirs(work)
        with open(os.path.join(pkg, "package.json"), "w") as f:
            json.dump({"name": "cb-npm-check", "version": "1.0.0", "main": "index.js"}, f)
        with open(os.path.join(pkg, "index.js"), "w") as f:
            f.write("module.exports = 42;\n")

        def npm(*args):
            r = subprocess.run(["npm", *args], cwd=work, capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, (args, r.stdout, r.stderr)
            return r.stdout

        assert npm("prefix").strip() == work
        tarball = npm("pack", "--pack-destination", top, pkg).strip().splitlines()[-1]
        npm("install", "--offline", os.path.join(top, tarball))
        assert sorted(os.listdir(work)) == ["node_modules"], os.listdir(work)  # no package.json
        r = subprocess.run(["node", "-e", "console.log(require('cb-npm-check'))"], cwd=work,
                           capture_output=True, text=True, timeout=60)
        assert r.stdout == "42\n", (r.stdout, r.stderr)
    finally:
        shutil.rmtree(top, ignore_errors=True)


# -- without pytest -----------------------------------------------------------------------------


def main():
    tests = [(n, f) for n, f in sorted(globals().items()) if n.startswith("test_") and callable(f)]
    failed = 0
    for name, fn in tests:
        t = time.monotonic()
        try:
            fn()
        except Skip as e:
            print("SKIP %s (%s)" % (name, e))
            continue
        except Exception:
            import traceback

            failed += 1
            print("FAIL %s" % name)
            traceback.print_exc()
            continue
        print("ok   %s (%.2fs)" % (name, time.monotonic() - t))
    print("%d passed, %d failed" % (len(tests) - failed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
