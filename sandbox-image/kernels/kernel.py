"""The persistent Python kernel of a codebroker sandbox.

The runner starts `python3 /opt/codebroker/kernel.py` with requests on fd 3 and events on
fd 4, one JSON object per line (sandbox-image/README.md, "The kernel protocol"):

    fd 4  <- {"event": "ready"}
    fd 3  -> {"id": N, "code": "...", "args": ["a", "b"]}        (+ "tools", "tool_socket")
    fd 4  <- {"event": "display", "id": N, "mime": "image/png", "name": "plot-1.png"}  (0 or more)
    fd 4  <- {"event": "done", "id": N, "exit_code": C}

C is 0 when the code finished, 1 for an uncaught exception (traceback on stderr, without
this file's frames), n for SystemExit(n). SIGINT during an exec raises KeyboardInterrupt in
the code, which ends the exec like any exception; SIGINT between execs is ignored.

Code runs like a notebook cell: globals persist in one `__main__` namespace, a trailing
expression's repr is printed, top-level `await` works (on one event loop kept across execs),
`plt.show()` saves the open figures as plot-<n>.png in the workspace and closes them (and
reports each as a `display` event).

A request with `"rich": true` (E2B's and Jupyter's front ends) shows values as MIME bundles
instead of printing them: a trailing expression's value, `display(obj)`, and figures still
open at the end of the cell each send one `display` event of MIME type
`application/x.codebroker-bundle+json` whose `data` is {"main": bool, "data": {mime: value}}
(binary values base64); an uncaught exception is sent as `application/x.codebroker-error+json`
({"name", "value", "traceback"}) instead of its traceback on stderr. The bundles are made by
kernel_rich.py, loaded on the first such request.

A request with `tools` (a list of {"name", "description", "parameters"}) and `tool_socket` (the
exec's tool socket) gets one `async def` per tool in the cell's globals, with a signature made
from the tool's JSON Schema, and `ToolError`; they are removed again before the next cell
(see "Tools" in kernel_tools.py).

Between cells the kernel cleans up after the one before: whatever the cell wrote is flushed
to fds 1 and 2 (repaired if the cell closed or replaced them) before `done`, and exited
children that nothing in the process will wait for are reaped (see "Children" below).

While a cell runs stdout is block buffered and flushed every 10 ms (see "Output buffering").

Start-up must be fast: nothing heavy (asyncio, matplotlib, and not even json, re, enum or
linecache) is imported until it is needed. Host testing: CODEBROKER_WORKDIR (default
/mnt/data) and CODEBROKER_MPL_CACHE (default /opt/codebroker/mplconfig) move the directories;
CODEBROKER_OUTPUT_FLUSH_MS changes the flush interval.
"""

import builtins
import _thread
import gc
import io
import os
import sys

# The C halves of signal, json and ast: their Python wrappers pull in enum and re, which
# would cost a good part of the start-up time. The wrappers are used where they are needed.
try:
    import _signal as signal
except ImportError:  # not CPython
    import signal
try:
    import _ast as ast_nodes
except ImportError:
    import ast as ast_nodes

WORKDIR = os.environ.get("CODEBROKER_WORKDIR") or "/mnt/data"
MPL_CACHE = os.environ.get("CODEBROKER_MPL_CACHE") or "/opt/codebroker/mplconfig"
# The image's ENV sets these; the defaults keep a kernel started elsewhere sane.
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("MPLCONFIGDIR", "/tmp/.matplotlib")

CO_COROUTINE = 0x0080  # inspect.CO_COROUTINE, without importing inspect
PyCF_ONLY_AST = 0x0400  # ast.PyCF_ONLY_AST
PyCF_ALLOW_TOP_LEVEL_AWAIT = 0x2000  # ast.PyCF_ALLOW_TOP_LEVEL_AWAIT

KERNEL_FILE = (lambda: None).__code__.co_filename  # as it appears in tracebacks
CELL_PREFIX = "<cell-"
TOOL_PREFIX = "<codebroker-tool "  # file names of the generated tool functions
TOOL_SOCKET_ENV = "CODEBROKER_TOOL_SOCKET"
KERNEL_PID = os.getpid()


# --------------------------------------------------------------------------------------------
# File descriptors
# --------------------------------------------------------------------------------------------

def _private_dup(fd):
    """A close-on-exec copy of fd, numbered high so user code is unlikely to hit it."""
    import fcntl

    for low in (1000, 512, 256, 100, 10):
        try:
            return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, low)
        except OSError as e:
            if e.errno == 9:  # EBADF: fd itself is not open
                raise
    return os.dup(fd)  # dup() is non-inheritable too


def _take_channel():
    """Move the request and event pipes off fds 3 and 4, out of reach of user code."""
    try:
        req, evt = _private_dup(3), _private_dup(4)
    except OSError:
        sys.stderr.write("kernel.py: needs the request pipe on fd 3 and the event pipe on fd 4\n")
        os._exit(2)
    os.close(3)
    os.close(4)
    return req, evt


def _same_file(a, b):
    try:
        sa, sb = os.fstat(a), os.fstat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


STD_STREAMS = ((0, "stdin"), (1, "stdout"), (2, "stderr"))

# Output buffering. While a cell runs, stdout is block buffered (a print is not a write(2)
# through the pipe and a wake-up of the runner) and a ticker thread flushes it every
# FLUSH_INTERVAL, so output still streams. stderr stays line buffered, and before anything
# is written to it buffered stdout goes out: the two pipes get the text in the order the
# code wrote it. Buffered output is also flushed when the buffer fills, before a tool call,
# a display event, a new process (subprocess, os.system, os.exec*, os.posix_spawn,
# os.spawn*, os.fork), and at the end of the cell; input() flushes stdout itself (stdin is
# /dev/null). Between cells stdout is line buffered, as user threads that go on printing
# expect. What bypasses Python's buffers, os.write(1, ...) or a C extension's printf, is not
# ordered against buffered prints: flush first (print(..., flush=True)), as in any Python
# program whose output is a pipe. The ticker needs the GIL: code that holds it in C for
# long (a huge regex, a big-integer power) delays the flush until it lets go.


def _flush_interval():
    """FLUSH_INTERVAL in seconds: 10 ms, or CODEBROKER_OUTPUT_FLUSH_MS (tests lengthen it to
    see the other flushes alone)."""
    try:
        ms = float(os.environ.get("CODEBROKER_OUTPUT_FLUSH_MS") or 10)
    except ValueError:
        ms = 10
    return (ms if 1 <= ms <= 3600000 else 10) / 1000  # also NaN


FLUSH_INTERVAL = _flush_interval()
# Audit events of a new process: what the cell printed goes out before the process writes.
PROCESS_EVENTS = frozenset(
    ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn")
)
STREAMS = [None]  # the kernel's Streams once it runs, for flush_output()


def _flushable(stream):
    """Whether the kernel may flush this stream from any thread: the io module's own text
    streams, not an object of the code's with a flush() of its own."""
    return type(stream) is io.TextIOWrapper or type(stream) is OrderedStderr


def _flush_stdout():
    out = sys.stdout
    if _flushable(out):
        try:
            out.flush()
        except Exception:
            pass
    streams = STREAMS[0]
    if streams is not None and streams.stdout is not out and _flushable(streams.stdout):
        try:
            streams.stdout.flush()
        except Exception:
            pass


def flush_output():
    """Send what the cell's Python streams hold (before a tool call, a new process, ...)."""
    streams = STREAMS[0]
    if streams is not None:
        streams.flush_buffers()


# How long a display event waits for the runner to read the output flushed before it.
DRAIN_WAIT = 0.05


def flush_output_and_wait():
    """flush_output, then wait (at most DRAIN_WAIT) until the runner has read fds 1 and 2:
    output and display events travel on different pipes, and a runner that wakes late
    would find the output printed before a display and after it in one read, and send the
    display after both."""
    flush_output()
    import fcntl
    import struct
    import termios
    import time

    deadline = time.monotonic() + DRAIN_WAIT
    buf = bytearray(struct.calcsize("i"))
    for fd in (1, 2):
        while True:
            try:
                fcntl.ioctl(fd, termios.FIONREAD, buf)
            except OSError:
                break  # not a pipe any more (the cell replaced it): nothing to wait for
            if struct.unpack("i", buf)[0] == 0 or time.monotonic() >= deadline:
                break
            time.sleep(0.0002)


class OrderedStderr(io.TextIOWrapper):
    """The kernel's stderr: buffered stdout is flushed before anything is written here."""

    def write(self, s):
        _flush_stdout()
        return io.TextIOWrapper.write(self, s)


def _flush_before_new_process(event, args):
    if event in PROCESS_EVENTS:
        flush_output()


class Streams:
    """The kernel's stdin/stdout/stderr, restored before every exec if user code replaced or
    closed them (sys.stdout = ..., sys.stdout.close(), os.close(1), os.dup2(f, 1), exit()),
    and their buffering (see FLUSH_INTERVAL)."""

    def __init__(self):
        # Private copies of fds 0-2, to repair them after os.close(1) or os.dup2(x, 1).
        self.saved = {fd: _private_dup(fd) for fd, _ in STD_STREAMS}
        # Line buffered between cells; not write-through (Python's default for pipes), which
        # would cost a write() per print() argument.
        try:
            sys.stdout.reconfigure(line_buffering=True, write_through=False)
        except Exception:
            pass
        err = sys.stderr
        try:
            err.flush()
            ordered = OrderedStderr(
                err.buffer, encoding=err.encoding, errors=err.errors, newline="\n",
                line_buffering=True,
            )
            err.detach()  # or its finalizer would close the buffer they share
            err = ordered
        except Exception:
            try:
                err.reconfigure(line_buffering=True, write_through=False)
            except Exception:
                pass
        sys.stderr = sys.__stderr__ = err
        self.stdin, self.stdout, self.stderr = sys.stdin, sys.stdout, err
        # Held by the ticker while it flushes, and across os.fork(): a child must not inherit
        # a buffer lock the ticker held (it would hang on its first print).
        self.lock = _thread.allocate_lock()
        # Wakes the ticker when a cell starts or ends (a binary semaphore: see _wake_ticker).
        self.wake = _thread.allocate_lock()
        self.wake.acquire()
        self.ticker_started = False
        self.ticking = False  # between begin() and end()
        STREAMS[0] = self
        try:
            os.register_at_fork(
                before=self._before_fork,
                after_in_parent=self.lock.release,
                after_in_child=self._after_fork_in_child,
            )
        except (AttributeError, RuntimeError):
            pass
        try:
            sys.addaudithook(_flush_before_new_process)
        except (AttributeError, RuntimeError):
            pass

    def _reopen(self, fd, old):
        enc = getattr(old, "encoding", None) or "utf-8"
        errors = getattr(old, "errors", None) or "strict"
        if fd == 0:
            return io.TextIOWrapper(io.open(fd, "rb", closefd=False), encoding=enc, errors=errors)
        raw = io.open(fd, "wb", closefd=False)
        kind = OrderedStderr if fd == 2 else io.TextIOWrapper
        return kind(raw, encoding=enc, errors=errors, newline="\n", line_buffering=True)

    def restore(self):
        for fd, name in STD_STREAMS:
            if not _same_file(fd, self.saved[fd]):
                try:
                    os.dup2(self.saved[fd], fd)
                except OSError:
                    pass
            stream = getattr(self, name)
            if stream.closed:
                stream = self._reopen(fd, stream)
                setattr(self, name, stream)
            setattr(sys, name, stream)
            setattr(sys, "__%s__" % name, stream)

    # -- buffering while a cell runs ----------------------------------------------------

    def _line_buffered(self, on):
        out = self.stdout
        try:
            if not out.closed and out.line_buffering != on:
                out.reconfigure(line_buffering=on)
        except Exception:
            pass

    def begin(self):
        """A cell starts: stdout block buffered, and flushed by the ticker."""
        if os.getpid() != KERNEL_PID:
            return
        self._line_buffered(False)
        self.ticking = True
        if not self.ticker_started:
            _thread.start_new_thread(self._tick, ())
            self.ticker_started = True
        self._wake_ticker()

    def end(self):
        """The cell is over: the ticker rests, stdout is line buffered again."""
        if self.ticking:
            self.ticking = False
            self._wake_ticker()
        self._line_buffered(True)

    def _wake_ticker(self):
        try:
            self.wake.release()
        except RuntimeError:
            pass  # released already and not taken yet: the ticker wakes all the same

    def _tick(self):
        # Signals are the main thread's: one taken here would not interrupt its blocking calls.
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        except (AttributeError, OSError, ValueError):
            pass
        while True:
            if not self.ticking:
                self.wake.acquire()  # until a cell starts
            elif not self.wake.acquire(True, FLUSH_INTERVAL) and self.ticking:
                with self.lock:
                    self.flush_buffers()

    def flush_buffers(self):
        """Flush the kernel's streams, and the code's own sys.stdout/sys.stderr when they
        are io text streams (see _flushable), stdout first."""
        seen = []
        for stream in (sys.stdout, self.stdout, sys.stderr, self.stderr):
            if stream in seen or not _flushable(stream):
                continue
            seen.append(stream)
            try:
                stream.flush()
            except Exception:
                pass

    def _before_fork(self):
        self.lock.acquire()
        self.flush_buffers()  # or the child would write the buffered text a second time

    def _after_fork_in_child(self):
        self.lock.release()
        self.ticking = False  # no ticker in the child: each line goes out when printed
        self._line_buffered(True)

    def flush(self):
        for stream in (sys.stdout, sys.stderr, self.stdout, self.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        if "ctypes" in sys.modules:  # C code that printf()s into libc's buffer
            try:
                import ctypes

                ctypes.CDLL(None).fflush(None)
            except Exception:
                pass


def _make_json_reader():
    """json.loads for one request line, from the C scanner of _json when there is one."""
    try:
        import _json
    except ImportError:
        _json = None

    class Context:
        strict = True
        object_hook = None
        object_pairs_hook = None
        parse_float = float
        parse_int = int

        @staticmethod
        def parse_constant(name):
            return {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}[name]

    scan = getattr(_json, "make_scanner", None)
    if scan is None:
        import json

        return json.loads
    scanner = scan(Context)

    def loads(text):
        text = text.strip()
        try:
            value, end = scanner(text, 0)
        except StopIteration:
            end = -1
        if end != len(text):
            import json

            return json.loads(text)  # raises the proper error
        return value

    return loads


def _json_value(value):
    if value is None:
        return "null"
    if type(value) is int:
        return str(value)
    if type(value) is str and value.isascii() and value.isalnum():
        return '"%s"' % value
    import json

    return json.dumps(value)


def _json_line(obj):
    """One event line (events are flat objects with plain keys)."""
    return "{%s}\n" % ",".join('"%s":%s' % (k, _json_value(v)) for k, v in obj.items())


class Channel:
    """Newline-delimited JSON over the private request/event fds."""

    def __init__(self, req_fd, evt_fd):
        self.req_fd, self.evt_fd = req_fd, evt_fd
        self.buf = bytearray()
        self.scanned = 0
        # The preload thread writes `log` events too: one line at a time on the pipe.
        import _thread

        self.send_lock = _thread.allocate_lock()

    def read(self):
        """The next request line, or None at end of input."""
        while True:
            i = self.buf.find(b"\n", self.scanned)
            if i >= 0:
                line = bytes(self.buf[:i])
                del self.buf[: i + 1]
                self.scanned = 0
                return line
            self.scanned = len(self.buf)
            chunk = os.read(self.req_fd, 1 << 16)
            if not chunk:
                return None
            self.buf += chunk

    def send(self, obj):
        if os.getpid() != KERNEL_PID:
            return
        data = memoryview(_json_line(obj).encode())
        with self.send_lock:
            while data:
                data = data[os.write(self.evt_fd, data):]


# --------------------------------------------------------------------------------------------
# Import hooks: linecache and matplotlib are set up when user code first imports them
# --------------------------------------------------------------------------------------------

SOURCES = {}  # linecache entries of the cells, for tracebacks, inspect and warnings


def register_source(filename, code):
    entry = (len(code), None, code.splitlines(True), filename)  # mtime None: never evicted
    SOURCES[filename] = entry
    linecache = sys.modules.get("linecache")
    # Being imported by the preload thread (a cell may run beside it): its `cache` may not
    # exist yet, and the import hook fills it from SOURCES once linecache is loaded.
    cache = getattr(linecache, "cache", None)
    if isinstance(cache, dict) and not getattr(getattr(linecache, "__spec__", None), "_initializing", False):
        cache[filename] = entry


def fill_linecache(linecache):
    for filename, entry in list(SOURCES.items()):  # a cell may add one meanwhile
        linecache.cache.setdefault(filename, entry)


# The user site (PYTHONUSERBASE/lib/pythonX.Y/site-packages, where `pip install` puts a
# session's packages: the image sets PIP_USER=1) is put on sys.path by `site` at start only if
# it exists then. A session's first `pip install` makes it later, so ImportHooks looks for it
# at each import of a top-level module not loaded yet (one isdir; nothing once it is added)
# and adds it as `site` would have: before the system's site-packages, its .pth files read.
# A package installed later into the existing directory needs nothing: the import system
# lists the directory again when its mtime changes (a pip run takes far longer than the
# clock tick of the coarsest file timestamps).
PENDING_USER_SITE = []  # the user site while it is not on sys.path yet (set by main)


def add_user_site():
    try:
        path = PENDING_USER_SITE.pop()  # first: the imports of .pth files come back here
    except IndexError:  # another thread took it
        return
    site = sys.modules["site"]
    n = len(sys.path)
    site.addsitedir(path)  # appends it and what its .pth files name
    first = [i for i, p in enumerate(sys.path[:n]) if p in site.getsitepackages()]
    if first:
        sys.path[first[0]:first[0]] = [sys.path.pop(n) for _ in range(len(sys.path) - n)]
    import importlib

    importlib.invalidate_caches()


class ImportHooks:
    """A meta path finder that acts on the first import of a few modules, so that the kernel
    need not import them itself: it prepares MPLCONFIGDIR before matplotlib is imported,
    replaces pyplot.show once pyplot is loaded, hands linecache the cells' sources, and has
    subprocess.Popen objects tracked (track_popen). It also puts the user site on sys.path
    once it appears (add_user_site)."""

    prepared = False

    def find_spec(self, fullname, path=None, target=None):
        if PENDING_USER_SITE and path is None and os.path.isdir(PENDING_USER_SITE[0]):
            add_user_site()
        if fullname == "matplotlib":
            self.prepare_config()
            return None
        if fullname == "matplotlib.pyplot":
            return self.spec_with_hook(fullname, path, target, patch_pyplot)
        if fullname == "matplotlib.artist":
            return self.spec_with_hook(fullname, path, target, defer_artist_set_docs)
        if fullname == "linecache":
            return self.spec_with_hook(fullname, path, target, fill_linecache)
        if fullname == "subprocess":
            return self.spec_with_hook(fullname, path, target, track_popen)
        return None

    def spec_with_hook(self, fullname, path, target, after):
        """The spec the other finders give, its loader calling after(module) once loaded."""
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_and_hook(module):
            exec_module(module)
            after(module)

        try:
            loader.exec_module = exec_and_hook  # this spec's own loader instance
        except Exception:
            pass
        return spec

    def invalidate_caches(self):
        pass

    def prepare_config(self):
        """Copy the font cache made at build time, so matplotlib does not rebuild it."""
        if ImportHooks.prepared:
            return
        ImportHooks.prepared = True
        dest = os.environ.get("MPLCONFIGDIR")
        if not dest:
            return
        try:
            os.makedirs(dest, exist_ok=True)
            names = os.listdir(MPL_CACHE)
        except OSError:
            return
        for name in names:
            src, dst = os.path.join(MPL_CACHE, name), os.path.join(dest, name)
            try:
                if os.path.isfile(src) and not os.path.exists(dst):
                    with open(src, "rb") as f:
                        data = f.read()
                    with open(dst, "wb") as f:
                        f.write(data)
            except OSError:
                pass


def _new_plot_file():
    """Create the first plot-<n>.png that does not exist yet (never following a link)."""
    n = 1
    while True:
        path = os.path.join(WORKDIR, "plot-%d.png" % n)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            n += 1
            continue
        return path, os.fdopen(fd, "wb")


DISPLAY = [None]  # the kernel's display(mime, name) once it runs, for plt.show()


class LazyArtistSet:
    """`set()` of one matplotlib Artist subclass whose signature and docstring are made
    when first asked for (`help()`, `inspect.signature`), not when the class is defined.
    matplotlib makes them for each of its ~70 Artist classes as pyplot is imported, by
    inspecting every setter: 110 to 140 ms of CPU, a sixth of a pooled kernel's preload,
    for text few sessions read (docs/PERFORMANCE.md). Calls go to `Artist.set` as
    matplotlib's own per-class `set` does."""

    _autogenerated_signature = True  # what Artist.__init_subclass__ looks for

    def __init__(self, cls, artist_set, build):
        self._cls, self._artist_set, self._build = cls, artist_set, build
        self._made, self._doc, self._signature = False, None, None
        self.__name__ = "set"
        self.__qualname__ = cls.__qualname__ + ".set"
        self.__module__ = cls.__module__

    def __call__(self, artist, **kwargs):
        return self._artist_set(artist, **kwargs)

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        import types

        return types.MethodType(self, obj)

    def _make(self):
        if not self._made:
            self._made = True
            self._build(self._cls)  # sets __signature__ and __doc__ through cls.set

    @property
    def __doc__(self):
        self._make()
        return self._doc

    @__doc__.setter
    def __doc__(self, text):
        self._doc = text

    @property
    def __signature__(self):
        self._make()
        return self._signature

    @__signature__.setter
    def __signature__(self, signature):
        self._signature = signature


def defer_artist_set_docs(artist):
    """Once matplotlib.artist is loaded: Artist subclasses defined from now on get a
    LazyArtistSet. Anything unexpected leaves matplotlib as it is."""
    base = getattr(artist, "Artist", None)
    update = getattr(base, "_update_set_signature_and_docstring", None)
    build = getattr(update, "__func__", None)
    artist_set = getattr(base, "set", None)
    if build is None or artist_set is None:
        return

    def deferred(cls):
        cls.set = LazyArtistSet(cls, artist_set, build)

    base._update_set_signature_and_docstring = classmethod(deferred)


def patch_pyplot(plt):
    if getattr(plt.show, "_codebroker", False):
        return
    original = plt.show

    def show(*args, **kwargs):
        """Save every open figure as plot-<n>.png in the workspace, then close it."""
        for num in plt.get_fignums():
            fig = plt.figure(num)
            path, f = _new_plot_file()
            try:
                with f:
                    fig.savefig(f, format="png")
            except BaseException:
                try:
                    os.unlink(path)
                except OSError:
                    pass
                raise
            finally:
                plt.close(fig)
            if DISPLAY[0] is not None:
                DISPLAY[0]("image/png", os.path.basename(path))

    show._codebroker = True
    show.__wrapped__ = original
    plt.show = show


# --------------------------------------------------------------------------------------------
# Children: reaping what user code forked and nobody waits for
# --------------------------------------------------------------------------------------------
#
# After each exec the runner SIGKILLs every process but itself and the kernel, so whatever a
# cell started and did not wait for (os.fork(), a Popen it dropped, a background job) ends up
# a zombie under the kernel, holding a pid of the container's pids limit until reaped.
#
# The kernel reaps without blocking (reap_children) at three points: before `done` (children
# that exited during the cell), on SIGCHLD while idle between cells (the runner's kills come
# right after `done`; the handler runs in the main thread, which is then blocked reading the
# next request, so it only ever runs kernel code), and at the start of each cell (anything
# the handler missed, say the SIGCHLD of a child of a user thread went to that thread).
# During a cell SIGCHLD is the cell's (whatever disposition it set, default otherwise), and
# nothing is reaped behind the code's back.
#
# A zombie that something in the process still means to wait for is not taken from it, so
# its exit status is not lost:
# - a subprocess.Popen that is alive and not yet waited for (asyncio's subprocesses are
#   Popens too): its wait()/poll() reaps it and gets the real status, -9 for the runner's
#   kill. Popen.__del__ reaps, or hands to subprocess._active, a child whose Popen is
#   dropped; those in _active are reaped here (subprocess copes with that);
# - a multiprocessing child: multiprocessing.active_children() reaps the finished ones and
#   records their exitcode, as multiprocessing itself does on each start().
# A bare os.fork()/os.posix_spawn() child is reaped, so os.waitpid() on it in a later cell
# raises ChildProcessError (within the cell that forked it, it is never reaped first).

POPENS = {}  # pid -> weak reference to the subprocess.Popen that started it


def track_popen(subprocess):
    """Have every subprocess.Popen record its pid in POPENS once its child is started."""
    cls = subprocess.Popen
    if getattr(cls.__init__, "_codebroker", False):
        return
    import functools
    import weakref

    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        pid = getattr(self, "pid", None)
        if pid:
            POPENS[pid] = weakref.ref(self)

    __init__._codebroker = True
    cls.__init__ = __init__


def _owned_pids():
    """Children that an object in the process will wait for (see above)."""
    owned = set()
    subprocess = sys.modules.get("subprocess")
    abandoned = {id(p) for p in list(getattr(subprocess, "_active", None) or ())}
    for pid, ref in POPENS.copy().items():  # copy(): a user thread may add one meanwhile
        p = ref()
        if p is None:
            if POPENS.get(pid) is ref:
                del POPENS[pid]
        elif p.returncode is None and p.pid == pid and id(p) not in abandoned:
            owned.add(pid)
    mp = sys.modules.get("multiprocessing")
    if mp is not None:
        try:
            owned.update(proc.pid for proc in mp.active_children() if proc.pid)
        except Exception:
            pass
    return owned


def _child_pids():
    """The kernel's children, from /proc."""
    task = "/proc/%d/task" % KERNEL_PID
    pids = set()
    if os.path.exists("%s/%d/children" % (task, KERNEL_PID)):
        for tid in os.listdir(task):
            try:
                with open("%s/%s/children" % (task, tid), "rb") as f:
                    pids.update(int(p) for p in f.read().split())
            except OSError:  # the thread has ended
                pass
        return pids
    # No /proc/<pid>/task/<tid>/children (CONFIG_PROC_CHILDREN): every process's parent.
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as f:
                stat = f.read()
            if int(stat[stat.rfind(b")") + 2 :].split()[1]) == KERNEL_PID:
                pids.add(int(name))
        except (OSError, ValueError, IndexError):
            pass
    return pids


def reap_children():
    """Reap, without blocking, the exited children that nothing in the process waits for."""
    if os.getpid() != KERNEL_PID:
        return
    try:
        if os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            return  # no child has exited: the common case, one system call
    except ChildProcessError:
        return  # no children at all
    except (AttributeError, OSError):
        pass
    owned = _owned_pids()
    if not owned:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
    try:
        pids = _child_pids()
    except OSError:
        return
    for pid in pids - owned:
        try:
            os.waitpid(pid, os.WNOHANG)  # 0 if it is still running
        except ChildProcessError:
            pass


def _reap_on_sigchld(signum, frame):
    try:
        reap_children()
    except Exception:
        pass


# --------------------------------------------------------------------------------------------
# Parts: what a kernel start does not need is loaded on first use
# --------------------------------------------------------------------------------------------
#
# Tool calls (kernel_tools.py), state saving (kernel_state.py) and rich results
# (kernel_rich.py) sit beside this file and are
# loaded the first time a request needs them, as modules that are not in sys.modules (user
# code cannot import them, as it cannot import this file). Their frames are the kernel's:
# tracebacks leave them out like this file's own.

PART_NAMES = ("tools", "state", "rich")
PART_FILES = {
    name: os.path.join(os.path.dirname(KERNEL_FILE), "kernel_%s.py" % name) for name in PART_NAMES
}
KERNEL_FILES = frozenset(PART_FILES.values()) | {KERNEL_FILE}
PARTS = {}  # name -> the loaded module


def part(name):
    """The module of part `name`, loaded on the first call (its bytecode is compiled into
    the image, so a load reads it rather than compiles it)."""
    module = PARTS.get(name)
    if module is None:
        import importlib.util
        from importlib.machinery import SourceFileLoader

        loader = SourceFileLoader("codebroker_kernel_" + name, PART_FILES[name])
        module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
        # What the parts share with the kernel (named at the top of each part).
        module.__dict__.update(
            flush_output=flush_output, register_source=register_source, TOOL_PREFIX=TOOL_PREFIX
        )
        loader.exec_module(module)
        PARTS[name] = module
    return module


# --------------------------------------------------------------------------------------------
# Preload: a pooled kernel imports the data stack while it waits for its session
# --------------------------------------------------------------------------------------------
#
# A pooled sandbox's kernel is asked, while it waits for its session, to import the broker's
# CODEBROKER_PRELOAD list: the runner writes `{"type": "preload", "modules": [...]}` on fd 3
# (when the broker says so: it lets only a few pooled kernels preload at once). A kernel that
# has received any other request first ignores it. A background thread then imports the
# modules one by one and, when matplotlib.pyplot is among them, draws one small figure and
# saves it to memory (and imports pandas' plotting backend when pandas is loaded), so that
# the first plot of the session finds the fonts, the Agg renderer, the PNG writer and
# pandas' plotting backend loaded. It ends with a
# `preloaded` event (the runner's `hello` answers say `preloading` until then).
#
# Nothing else of it is visible to the session: the figure is a bare matplotlib.figure.Figure
# (never registered with pyplot, so plt.get_fignums() stays [] and no figure number is used),
# no option or rc parameter is changed, and the thread ends when done. It runs at the lowest
# priority, and it stops at the first other request the kernel gets (a cell, or the runner's
# `stop_preload` when the session's first exec is in another language): from then on the
# session's own code decides what it imports, and a taken container spends no CPU on
# modules its session may never use. The import under way when it stops runs to its end,
# and the request waits for it: a cell running beside an import can meet a module half
# initialized (Python's answer to two threads importing each other's modules). A cell whose
# code names no import and that has no tools runs at once, beside the import under way
# (`runs_beside_an_import`), and the import stops at its next import statement until the
# cell ends (`Preload.pause_for_cell`); if it fails, its traceback waits for that import.
# The preload stops all the same: letting it go on beside such a cell (the next one might import
# pandas) cost each taken container up to 0.4 s more CPU, which a burst of new sessions
# took from the refills and from each other (docs/PERFORMANCE.md). A
# fork() (multiprocessing) waits for the import under way to finish, so the child never
# inherits a half-imported module whose lock belongs to a thread it does not have. A name
# that is not a dotted identifier, or whose import fails, is reported in a `log` event (the
# runner writes it to its stderr, which the broker logs) and skipped.
#
# The cyclic garbage collector is paused while the preload imports: importing the data stack
# allocates some 100,000 objects that live as long as the process, and the collections they
# trigger cost about a tenth of the preload's CPU (45 of 460 ms), which every pool refill
# pays. The pause ends by freezing what was loaded (`gc.freeze()`), so the session's
# collections do not walk the modules' objects either (its first plot is 4 ms faster, and
# the first cell after a stopped preload does not pay for a collection of everything the
# paused imports allocated). The pause ends before any cell can run: the thread resumes
# collection when it ends, and so does a request's wait for the import under way, or a cell
# that runs beside that import (the rest of which then runs with collection on: a stopped
# preload pauses nothing again).

PRELOAD_THREAD_NAME = "cb-preload"  # the thread's name in /proc (15 characters at most)
FORK_WAITS_FOR_IMPORT = 5.0  # seconds; a backstop, an import takes well under one
CELL_PAUSES_IMPORT = 1.0  # seconds a cell beside the import may hold the thread at most


def runs_beside_an_import(req):
    """Whether a request may run while the preload's import under way ends, instead of
    waiting for it: a cell whose code names no import and that is given no tools
    (`print(1)`, reading a file). Such a cell starts no import of its own, so it cannot meet
    a module the preload has half initialized; beside the import it shares the GIL until
    the import ends, where waiting would cost it up to the whole of pandas' import (about
    150 ms of CPU). Anything else waits (see "Preload")."""
    if req.get("type") not in (None, "exec"):
        return False
    code = req.get("code")
    return (
        isinstance(code, str)
        and not any(word in code for word in IMPORTING_WORDS)
        and not req.get("tools")
    )


# Words of a cell's code that make the kernel or Python import a module: an import of any
# kind, top-level await (the kernel imports asyncio), help() (pydoc), breakpoint() (pdb).
IMPORTING_WORDS = ("import", "await", "async", "help(", "breakpoint(")


def fully_loaded(name):
    """Whether `name` and its parents are in sys.modules and done initializing: importing
    them again takes no module lock (what importlib itself checks). Opening a text file
    imports `locale` so, and must not end a cell's pause of the preload."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        module = sys.modules.get(".".join(parts[:i]))
        if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
            return False
    return True


def preload_names(modules):
    """The module names of a `preload` request's list, and the entries that are not names."""
    names, bad = [], []
    for entry in modules if isinstance(modules, list) else [modules]:
        entry = entry.strip() if isinstance(entry, str) else entry
        if not entry:
            continue
        if isinstance(entry, str) and all(
            part.isidentifier() and part.isascii() for part in entry.split(".")
        ):
            if entry not in names:
                names.append(entry)
        else:
            bad.append(entry)
    return names, bad


class Preload:
    """Imports `names` in a background thread until the first request (see "Preload")."""

    def __init__(self, names, bad, kernel):
        import _thread

        self.names, self.bad, self.kernel = names, bad, kernel
        self.importing = _thread.allocate_lock()  # held during each import, for fork()
        self.thread_id = None
        self.stopped = False  # set by the main thread at the first request
        self.ended = False  # set by the thread when it is done (under `switching`)
        self.switching = _thread.allocate_lock()  # guards `ended` and the switch interval
        self.saved_switch = None  # the interval before a cell ran beside the preload
        self.gc_paused = False  # this preload turned the garbage collector off (under gc_lock)
        self.gc_lock = _thread.allocate_lock()  # pause and resume: the thread's or a cell's
        self.gate = _thread.allocate_lock()  # held by a cell beside the import: the thread waits
        self.gating = _thread.allocate_lock()  # guards `paused_import` and `builtins.__import__`
        self.paused_import = None  # the __import__ a gated cell replaced, until it ends

    def share_gil_finely(self):
        """From the thread's start: until it ends, hand the GIL over every 0.5 ms instead
        of 5. The thread holds the GIL while it imports, and each time the kernel's main
        thread comes back from a read or a write it waits for a switch: beside a busy
        import, a small cell took 6-22 ms with the default interval and 1-7 ms with this
        one (before it held the import at its next import statement). The thread puts the
        interval back when it ends."""
        with self.switching:
            if self.ended or self.saved_switch is not None:
                return
            self.saved_switch = sys.getswitchinterval()
            sys.setswitchinterval(min(self.saved_switch, 0.0005))

    def pause_for_cell(self):
        """Before a cell that runs beside the import under way: the thread stops at its
        next import statement until the cell ends, so the cell has the GIL to itself
        instead of taking turns with the import every 0.5 ms. The pause point is
        `builtins.__import__`, replaced for the cell's duration only: it is called before
        the import takes any lock, so the thread waits holding only the locks of the
        modules it is inside, which a cell that names no import does not need. An import
        the cell makes all the same (a codec looked up, the rich display's helpers) ends
        the pause first, and the thread waits CELL_PAUSES_IMPORT at most, should a
        cell need one of its modules by a path that passes no `__import__`."""
        with self.gating:
            if self.ended or self.paused_import is not None:
                return
            self.gate.acquire()
            self.paused_import = builtins.__import__
            builtins.__import__ = self.gated_import

    def resume_after_cell(self):
        """Ends a cell's pause: the thread goes on with the import under way."""
        with self.gating:
            if self.paused_import is None:
                return
            if builtins.__import__ == self.gated_import:
                builtins.__import__ = self.paused_import
            self.paused_import = None
            self.gate.release()

    def gated_import(self, name, globals=None, locals=None, fromlist=(), level=0):
        original = self.paused_import or __import__
        if _thread.get_ident() == self.thread_id:
            if self.gate.acquire(timeout=CELL_PAUSES_IMPORT):
                self.gate.release()
        elif level or not fully_loaded(name):
            self.resume_after_cell()  # the cell imports: the thread may hold that module
        return original(name, globals, locals, fromlist, level)

    def end_fine_sharing(self):
        with self.switching:
            self.ended = True
            if self.saved_switch is not None:
                sys.setswitchinterval(self.saved_switch)
                self.saved_switch = None

    def stop(self):
        self.stopped = True

    def pause_gc(self):
        """Turns the collector off for the imports, unless it is off already or a request
        came (a cell then runs with it on)."""
        with self.gc_lock:
            if not self.stopped and not self.gc_paused and gc.isenabled():
                gc.disable()
                self.gc_paused = True

    def resume_gc(self):
        """Turns the collector back on if this preload turned it off, after freezing what
        was imported meanwhile: collected now, the objects of the paused imports would all
        be walked at the session's first allocation (tens of milliseconds in the first cell
        after a preload that was stopped). Called by the thread when it ends, by a request
        that waited for the import under way, and before a cell that runs beside it (so
        that neither the cell's garbage is frozen nor its collections paused)."""
        with self.gc_lock:
            if self.gc_paused:
                self.gc_paused = False
                gc.freeze()
                gc.enable()

    def wait_for_import_under_way(self):
        """Blocks until the import under way (if any) has ended. A cell must not run beside
        it: two threads importing modules that import each other (traceback and linecache
        while pandas loads) get one of them half initialized, since Python breaks such an
        import deadlock by handing out the partial module. The cell that follows runs with
        the garbage collector on, and with the usual GIL switch interval (the preload is
        stopped: nothing is imported beside it any more)."""
        self.resume_after_cell()
        if self.importing.acquire(timeout=FORK_WAITS_FOR_IMPORT):
            try:
                self.resume_gc()
                if self.stopped:
                    self.end_fine_sharing()
            finally:
                self.importing.release()

    def start(self):
        # threading is imported here, in the main thread, so that threading.main_thread() is
        # the kernel's main thread whoever imports threading next.
        import threading

        os.register_at_fork(before=self.before_fork)
        thread = threading.Thread(target=self.run, name="codebroker-preload", daemon=True)
        thread.start()

    def before_fork(self):
        import _thread

        if _thread.get_ident() == self.thread_id:
            return  # a module of the list that forks while it is imported
        self.resume_after_cell()
        if self.importing.acquire(timeout=FORK_WAITS_FOR_IMPORT):
            if self.stopped:
                self.end_fine_sharing()  # the child has no preload thread to put it back
            self.importing.release()

    def log(self, text):
        try:
            self.kernel.channel.send({"event": "log", "message": "preload: " + text[:500]})
        except Exception:
            pass

    def run(self):
        import _thread

        self.thread_id = _thread.get_ident()
        try:
            # Its name in ps and /proc, so the work of a pooled container can be told apart.
            with open("/proc/thread-self/comm", "w") as f:
                f.write(PRELOAD_THREAD_NAME)
        except OSError:
            pass
        try:
            # Nice is per thread on Linux: a program the session runs in another language
            # meanwhile (which the kernel does not see) keeps the container's CPU.
            os.setpriority(os.PRIO_PROCESS, _thread.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        # The first request's own read of fd 3 then waits 0.5 ms for the GIL, not 5: with no
        # other thread asking for it, the interval costs the imports nothing.
        self.share_gil_finely()
        try:
            self.import_all()
        finally:
            self.end_fine_sharing()
            with self.importing:
                self.resume_gc()
            # The runner's `hello` answers say `preloading` until this arrives; the broker
            # then gives the pooled container its CPU weight back.
            try:
                self.kernel.channel.send({"event": "preloaded", "stopped": self.stopped})
            except Exception:
                pass

    def import_all(self):
        for entry in self.bad:
            self.log("not a module name, skipped: %r" % entry)
        for name in self.names:
            if self.stopped:
                return
            if name in sys.modules:
                continue
            try:
                with self.importing:
                    # Checked again under the lock: a request that came meanwhile has set
                    # `stopped` and no longer waits for this import.
                    if self.stopped:
                        return
                    self.pause_gc()
                    __import__(name)
            except BaseException as e:  # whatever a module raises, the kernel goes on
                self.log("cannot import %s: %s: %s" % (name, type(e).__name__, e))
        if self.stopped:
            return
        if "matplotlib.pyplot" in self.names and "matplotlib.pyplot" in sys.modules:
            try:
                with self.importing:
                    if self.stopped:
                        return
                    self.pause_gc()
                    warm_up_plotting()
            except BaseException as e:
                self.log("cannot warm up plotting: %s: %s" % (type(e).__name__, e))


def warm_up_plotting():
    """Load what the first plot loads, without drawing: the Agg canvas, Pillow's PNG
    writer, the default font (parsed once, then cached by matplotlib) and, with pandas
    loaded, pandas' plotting backend (the first df.plot() imports it). Drawing a figure
    here as well cost each pool refill 40 ms of CPU to save the session's first plot
    about 15 ms (docs/PERFORMANCE.md), and on a busy host the pool's CPU is what keeps it
    ahead of new sessions."""
    import PIL.PngImagePlugin  # noqa: F401 (what savefig(..png) imports first)
    from matplotlib import font_manager
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401

    if "pandas" in sys.modules:
        import pandas.plotting._matplotlib  # noqa: F401 (what df.plot() imports first)
    font_manager.get_font(font_manager.findfont(font_manager.FontProperties()))


# --------------------------------------------------------------------------------------------
# Running code
# --------------------------------------------------------------------------------------------

def shell_escapes(code):
    """`code` with its notebook shell lines as Python, or None when it has none: a line
    `!cmd` runs `cmd` in the shell, `%pip args` runs this Python's pip, as in Jupyter (the
    output streams, a failing command does not fail the cell, nothing is printed for the
    call itself). Lines keep their numbers and indentation, so tracebacks still point at
    the cell's own lines."""
    lines = code.split("\n")
    changed = False
    for i, line in enumerate(lines):
        body = line.lstrip()
        indent = line[: len(line) - len(body)]
        if body.startswith("!") and not body.startswith("!="):
            command = body[1:]
        elif body.startswith("%pip ") or body == "%pip":
            command = "%s -m pip %s" % (sys.executable, body[4:].strip())
        else:
            continue
        lines[i] = "%s__import__('subprocess').run(%r, shell=True) and None" % (indent, command)
        changed = True
    return "\n".join(lines) if changed else None


def _ignore_sigint(signum, frame):
    pass


class Kernel:
    def __init__(self, channel, streams):
        self.channel = channel
        self.streams = streams
        self.cells = 0
        self.loop = None
        self.main = type(sys)("__main__")
        self.main.__dict__.update(__builtins__=__builtins__, __spec__=None, __loader__=None)
        self.ns = self.main.__dict__
        self.loads = _make_json_reader()
        self.idle = False  # between cells: SIGCHLD is the kernel's (reap_while_idle)
        self.cell_sigchld = None  # the SIGCHLD disposition a cell set, given back to the next
        self.request_id = None  # the request being run, for display events
        self.rich = False  # the request wants MIME bundles (kernel_rich.py)
        self.tool_globals = {}  # name -> object the kernel put in the globals for tools
        self.preload = None  # the Preload a `preload` request started
        self.requests_seen = False  # a request other than `preload` came: no preload now
        DISPLAY[0] = self.display

    # -- between cells ---------------------------------------------------------------------

    def reap_while_idle(self):
        """After a cell: reap its exited children, and those that exit until the next cell
        (the runner kills the cell's leftovers right after `done`) on SIGCHLD."""
        if not self.idle:
            self.idle = True
            try:
                self.cell_sigchld = signal.getsignal(signal.SIGCHLD)
                if self.cell_sigchld is not None:  # None: set outside Python, left alone
                    signal.signal(signal.SIGCHLD, _reap_on_sigchld)
            except (AttributeError, ValueError, OSError):
                self.cell_sigchld = None
        reap_children()  # after the handler is set, so no child's exit goes unnoticed

    def end_idle(self):
        """Before a cell: SIGCHLD back as the cells left it; reap what the handler missed."""
        if self.idle:
            self.idle = False
            if self.cell_sigchld is not None:
                try:
                    signal.signal(signal.SIGCHLD, self.cell_sigchld)
                except (ValueError, OSError):
                    pass
                self.cell_sigchld = None
        reap_children()

    def display(self, mime, name):
        """Tell the runner about a file the cell showed (a saved figure)."""
        flush_output_and_wait()  # what was printed before the figure comes before it
        try:
            self.channel.send({"event": "display", "id": self.request_id, "mime": mime, "name": name})
        except OSError:
            pass

    # -- Rich results (kernel_rich.py) ------------------------------------------------------

    def send_rich(self, mime, payload):
        """A display event carrying `payload` as JSON (a bundle or an error)."""
        flush_output_and_wait()  # what was printed before the value comes before it
        try:
            import json

            self.channel.send(
                {"event": "display", "id": self.request_id, "mime": mime, "data": json.dumps(payload)}
            )
        except (OSError, TypeError, ValueError):
            pass

    def install_tools(self, tools, socket_path):
        """Replace the previous cell's tool functions by this cell's (see "Tools" in kernel_tools.py)."""
        for name, obj in self.tool_globals.items():
            if self.ns.get(name) is obj:
                del self.ns[name]
        self.tool_globals = {}
        if not tools:
            os.environ.pop(TOOL_SOCKET_ENV, None)
            return
        if socket_path:
            os.environ[TOOL_SOCKET_ENV] = socket_path  # for `sandbox-runner tool-call` and co.
        else:
            os.environ.pop(TOOL_SOCKET_ENV, None)
        tools_part = part("tools")
        names = tools_part.tool_function_names([t["name"] for t in tools])
        for func_name, tool in zip(names, tools):
            self.tool_globals[func_name] = tools_part.make_tool_function(func_name, tool, socket_path)
        self.tool_globals["ToolError"] = tools_part.ToolError
        self.ns.update(self.tool_globals)
        # Tool-calling code is written as `await asyncio.gather(...)` without an import
        # (LibreChat's tool description says so, and its own sandbox imports it first).
        if "asyncio" not in self.ns:
            import asyncio
            self.ns["asyncio"] = asyncio

    def finish(self, error):
        """End a cell so that everything it wrote reaches fds 1 and 2 before `done`."""
        # First to where the cell pointed them (a file it dup2'd onto fd 1, say), then, with
        # fds and streams repaired, what could not be written (fd 1 was closed, say): it is
        # this cell's output and must not turn up in the next one's.
        self.streams.flush()
        self.streams.restore()
        if error is not None:
            self.report(error)
        self.streams.end()
        self.streams.flush()

    # -- one exec ------------------------------------------------------------------------

    def prepare(self, args):
        self.end_idle()
        self.streams.restore()
        self.streams.begin()
        sys.modules["__main__"] = self.main
        sys.argv = ["main.py"] + [str(a) for a in args]
        try:
            os.chdir(WORKDIR)
        except OSError:
            pass
        if not sys.path or sys.path[0] != WORKDIR:
            while WORKDIR in sys.path:
                sys.path.remove(WORKDIR)
            sys.path.insert(0, WORKDIR)
        # Files written since the last exec are importable: what importlib.invalidate_caches()
        # does, without importing importlib (a cell beside the preload must import nothing).
        for finder in sys.meta_path:
            try:
                finder.invalidate_caches()
            except Exception:
                pass

    def compile(self, code):
        """The cell as (body code object, trailing expression code object or None)."""
        self.cells += 1
        filename = "%s%d>" % (CELL_PREFIX, self.cells)
        register_source(filename, code)
        try:
            tree = compile(code, filename, "exec", PyCF_ONLY_AST, dont_inherit=True)
        except SyntaxError:
            # Notebook habits: `!pip install x`, `%pip install x`. Only a cell that is not
            # Python as written is read this way, so valid code never changes meaning.
            escaped = shell_escapes(code)
            if escaped is None:
                raise
            try:
                tree = compile(escaped, filename, "exec", PyCF_ONLY_AST, dont_inherit=True)
            except SyntaxError:
                tree = None
            if tree is None:
                raise
        last = None
        if tree.body and isinstance(tree.body[-1], ast_nodes.Expr):
            last = ast_nodes.Expression(tree.body.pop().value)
        flags = PyCF_ALLOW_TOP_LEVEL_AWAIT
        body = compile(tree, filename, "exec", flags, dont_inherit=True)
        expr = compile(last, filename, "eval", flags, dont_inherit=True) if last else None
        return body, expr

    def evaluate(self, code):
        result = eval(code, self.ns)
        if code.co_flags & CO_COROUTINE:
            result = self.run_coroutine(result)
        return result

    def run_coroutine(self, coro):
        import asyncio

        if self.loop is None or self.loop.is_closed():
            self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        task = self.loop.create_task(coro)
        try:
            return self.loop.run_until_complete(task)
        except BaseException:
            if not task.done():
                task.cancel()  # an interrupted cell must not resume in the next one
                try:
                    self.loop.run_until_complete(task)
                except BaseException:
                    pass
            raise

    def run(self, code, args, tools=None, tool_socket=None):
        """Run one cell; (exit code, the exception to report or None)."""
        signal.signal(signal.SIGINT, signal.default_int_handler)
        self.prepare(args)
        if self.rich:
            builtins = self.ns.get("__builtins__")
            target = builtins if isinstance(builtins, dict) else getattr(builtins, "__dict__", {})
            if "display" not in target:
                target["display"] = part("rich").display_function(self.send_rich)
        try:
            self.install_tools(tools, tool_socket)
            body, expr = self.compile(code)
            self.evaluate(body)
            value = None
            if expr is not None:
                value = self.evaluate(expr)
            if self.rich:
                part("rich").show_open_figures(self.send_rich)
            if value is not None and not code.rstrip().endswith(";"):
                if self.rich:
                    part("rich").show(value, True, self.send_rich)
                else:
                    print(repr(value))
            return 0, None
        except SystemExit as e:
            signal.signal(signal.SIGINT, _ignore_sigint)
            return self.exit_code(e)
        except BaseException as e:
            signal.signal(signal.SIGINT, _ignore_sigint)
            return 1, e
        finally:
            signal.signal(signal.SIGINT, _ignore_sigint)

    def exit_code(self, e):
        """SystemExit's (exit code, what to report); a message is reported, like Python does."""
        code = e.code
        if code is None:
            return 0, None
        if isinstance(code, int):
            return code & 0xFF, None
        return 1, e

    # -- tracebacks ----------------------------------------------------------------------

    def user_traceback(self, exc):
        """The traceback from the first frame of a cell on, without this file's frames."""
        entries = []
        tb = exc.__traceback__
        while tb is not None:
            entries.append(tb)
            tb = tb.tb_next
        for i, entry in enumerate(entries):
            if entry.tb_frame.f_code.co_filename.startswith(CELL_PREFIX):
                entries = entries[i:]
                break
        else:
            if isinstance(exc, KeyboardInterrupt):
                # Interrupted outside any cell frame (say, in the event loop's select):
                # the frames would only show the kernel's machinery.
                return None
        entries = [
            t for t in entries
            if t.tb_frame.f_code.co_filename not in KERNEL_FILES
            and not t.tb_frame.f_code.co_filename.startswith(TOOL_PREFIX)
        ]
        new = None
        for t in reversed(entries):
            new = type(t)(new, t.tb_frame, t.tb_lasti, t.tb_lineno)
        return new

    def report(self, exc):
        """Write exc's traceback (a SystemExit's message) to the kernel's stderr; in rich
        mode, send it as an error event instead."""
        if self.rich and not isinstance(exc, SystemExit):
            try:
                import linecache
                import traceback

                fill_linecache(linecache)
                tb = self.user_traceback(exc)
                exc.__traceback__ = tb
                sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
                text = "".join(traceback.format_exception(type(exc), exc, tb))
                try:
                    value = str(exc)
                except BaseException:
                    value = ""
                error = {"name": type(exc).__name__, "value": value, "traceback": text}
                self.send_rich(part("rich").ERROR_MIME, error)
                return
            except BaseException:
                pass
        if isinstance(exc, SystemExit):
            try:
                text = "%s\n" % (exc.code,)
            except BaseException:
                text = "SystemExit\n"
            self.write_error(text)
            return
        try:
            import linecache
            import traceback

            fill_linecache(linecache)  # in case user code cleared it
            tb = self.user_traceback(exc)
            exc.__traceback__ = tb
            sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
            lines = traceback.format_exception(type(exc), exc, tb)
        except BaseException:
            lines = ["%s: %s\n" % (type(exc).__name__, exc)]
        self.write_error("".join(lines))

    def write_error(self, text):
        # The kernel's own stderr, just repaired (finish), not one the cell put in sys.stderr:
        # the traceback is for the runner, and written once.
        try:
            self.streams.stderr.write(text)
            self.streams.stderr.flush()
        except BaseException:
            pass

    # -- the request loop -----------------------------------------------------------------

    def start_preload(self, modules):
        """A `preload` request: only before any other request, and only once."""
        if self.preload is not None or self.requests_seen:
            return
        names, bad = preload_names(modules)
        preload = Preload(names, bad, self)
        preload.start()  # if no thread can start, there is no preload
        self.preload = preload

    def serve_state(self, req):
        """A `save_state` or `restore_state` request (see "State" in kernel_state.py), run like a cell: in the
        workspace, with `__main__` in place, streams repaired after it."""
        saving = req.get("type") == "save_state"
        path, max_bytes = req.get("path"), req.get("max_bytes")
        timeout_ms = req.get("timeout_ms")
        fields = None
        if not isinstance(path, str) or type(max_bytes) is not int or max_bytes <= 0:
            fields = {"error": "bad request: path and max_bytes are needed"}
        elif not saving and self.cells:
            fields = {"restored": 0, "error": "the kernel has run code already"}
        if fields is None:
            self.prepare([])
            state = None
            try:
                state = part("state")
                if saving:
                    limit = timeout_ms if type(timeout_ms) is int and timeout_ms > 0 else 30000
                    fields = state.save_state(self.ns, path, max_bytes, limit)
                else:
                    fields = state.restore_state(self.ns, path, max_bytes)
            except BaseException as e:
                fields = {"error": state.reported_error(e) if state else repr(e)[:200]}
            finally:
                if not saving:
                    try:
                        os.unlink(path)  # its bytes are in the namespace now; /tmp is memory
                    except OSError:
                        pass
            self.finish(None)
            if os.getpid() != KERNEL_PID:
                os._exit(0)  # a fork() in a __reduce__ must not answer for the kernel
            self.reap_while_idle()
        event = {"event": "state_saved" if saving else "state_restored", "id": req.get("id")}
        event.update(fields)
        try:
            self.channel.send(event)
        except OSError:
            pass

    def serve(self):
        self.channel.send({"event": "ready"})
        while True:
            try:
                line = self.channel.read()
            except OSError:
                line = None
            if line is None:
                return
            req_id, exit_code, error = None, 1, None
            try:
                try:
                    req = self.loads(line.decode("utf-8"))
                    if not isinstance(req, dict):
                        raise ValueError("not a JSON object")
                    if req.get("type") == "preload":
                        self.start_preload(req.get("modules"))
                        continue  # not answered
                    self.requests_seen = True
                    beside = self.preload is not None and runs_beside_an_import(req)
                    if self.preload is not None:
                        self.preload.stop()  # the session's code decides what it imports now
                    if req.get("type") == "stop_preload":
                        continue  # the runner's, for an exec in another language: no answer
                    if beside:
                        self.preload.resume_gc()  # the cell's own garbage is collected as usual
                        self.preload.pause_for_cell()
                    elif self.preload is not None:
                        self.preload.wait_for_import_under_way()
                    if req.get("type") in ("save_state", "restore_state"):
                        self.serve_state(req)
                        continue
                    req_id = req.get("id")
                    code, args = req.get("code", ""), req.get("args") or []
                    if not isinstance(code, str) or not isinstance(args, list):
                        raise ValueError("code must be a string and args a list")
                    tools = req.get("tools") or []
                    if not isinstance(tools, list):
                        raise ValueError("tools must be a list")
                    tools = [t for t in tools if isinstance(t, dict) and isinstance(t.get("name"), str)]
                    tool_socket = req.get("tool_socket")
                    if not isinstance(tool_socket, str):
                        tool_socket = None
                except Exception as e:
                    try:
                        self.streams.stderr.write("kernel.py: bad request: %s\n" % e)
                    except Exception:
                        pass
                else:
                    self.request_id = req_id
                    self.rich = req.get("rich") is True
                    exit_code, error = self.run(code, args, tools, tool_socket)
            except KeyboardInterrupt:
                # SIGINT landed in the kernel's own code around the cell: still an interrupt.
                signal.signal(signal.SIGINT, _ignore_sigint)
                exit_code = 1
            finally:
                if self.preload is not None:
                    self.preload.resume_after_cell()
            if error is not None and self.preload is not None:
                # A cell that ran beside the import under way reports its error with
                # traceback and linecache, which that import may be loading.
                self.preload.wait_for_import_under_way()
            self.finish(error)
            if os.getpid() != KERNEL_PID:
                os._exit(exit_code)  # a fork() in user code must not answer for the kernel
            os.environ.pop(TOOL_SOCKET_ENV, None)  # the socket is gone with the exec
            self.reap_while_idle()
            try:
                self.channel.send({"event": "done", "id": req_id, "exit_code": exit_code})
            except OSError:
                return


def main():
    signal.signal(signal.SIGINT, _ignore_sigint)
    req_fd, evt_fd = _take_channel()
    streams = Streams()
    # The kernel's own directory must not shadow user modules (or offer `import kernel`).
    if sys.path and sys.path[0] == os.path.dirname(KERNEL_FILE):
        sys.path[0] = WORKDIR
    sys.meta_path.insert(0, ImportHooks())
    site = sys.modules.get("site")  # none with python3 -S; no user site with -s or -I
    user_site = getattr(site, "ENABLE_USER_SITE", False) and getattr(site, "USER_SITE", None)
    if user_site and user_site not in sys.path:
        PENDING_USER_SITE.append(user_site)
    kernel_module = sys.modules["__main__"]  # keeps this module alive once user code owns __main__
    kernel = Kernel(Channel(req_fd, evt_fd), streams)
    try:
        kernel.serve()
    finally:
        streams.flush()
        del kernel_module
    os._exit(0)  # no user atexit handlers or thread joins between the runner and a clean exit


if __name__ == "__main__":
    main()
