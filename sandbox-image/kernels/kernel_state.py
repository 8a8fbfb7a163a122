"""Python state of the codebroker kernel: loaded by kernel.py (`part("state")`) when the
runner asks to save or restore the globals, so a kernel start does not pay for it.
"""

import _thread
import io
import os
import sys

# --------------------------------------------------------------------------------------------
# State: the globals saved to a file before the sandbox goes, restored in the next one
# --------------------------------------------------------------------------------------------
#
# When the broker removes a session's container (idle, evicted, shut down) it first asks the
# runner to save the kernel's globals: `{"type": "save_state", "id": N, "path": P,
# "max_bytes": B, "timeout_ms": T}`, answered by `{"event": "state_saved", "id": N, "bytes":
# n, "saved": k, "modules": m, "skipped": [[name, why], ...], "error": null}`. The next
# container's kernel, before its first cell, gets `{"type": "restore_state", "id": N,
# "path": P, "max_bytes": B}`, answered by `{"event": "state_restored", "id": N,
# "restored": k, "failed": [[name, why], ...], "error": null}`. Both count as requests: a
# preload under way stops.
#
# What is saved: every global but dunder names. A module (`import pandas as pd`, `from os
# import path`) is recorded by name and imported again. Open files, sockets, threads, locks,
# generators, coroutines, frames and running processes cannot outlive their process: they are
# named in `skipped` with what they are. Everything else is pickled with cloudpickle, which
# pickles classes and functions defined in cells (in `__main__`) by value; functions restored
# see the restored namespace as their globals, as they did before. One pickler writes the
# names one after another, so objects shared between names stay shared; a name whose
# pickling fails (an unpicklable object inside it, or bytes over the bound) is cut off the
# file and named in `skipped` with the error, and the next name starts a fresh pickler.
#
# Bounds: the file never grows past B bytes, and past T milliseconds the name being written
# is dropped and the rest are skipped (what was written is kept). Unpickling happens only
# here, in the sandbox of the session that saved it: the broker moves the file's bytes and
# never reads them.
#
# The file: a magic line, the pickles, a JSON index of the names (where each starts and
# ends, which start a fresh pickler, the modules), and a trailer: 8 bytes of the index's
# offset, little-endian, then STATE_TRAILER. A restore checks the size, the magic, the
# trailer and the index before it unpickles anything, and a name that fails to load is
# reported, never fatal: the kernel goes on with what loaded.

STATE_MAGIC = b"codebroker python state 1\n"
STATE_TRAILER = b"CBSTATE1"
STATE_MAX_INDEX = 16 << 20  # bytes of index a restore reads at most
STATE_MAX_REPORTED = 100  # names listed in an answer; the count says the rest
STATE_NAME_CHARS = 200  # characters of a name or reason in an answer


class _OverBound(Exception):
    pass


class _OutOfTime(Exception):
    pass


class _StateSink:
    """The state file as the pickler's output: writes past the byte bound or the deadline
    raise, so a save stops within both (see "State")."""

    def __init__(self, fd, max_bytes, deadline):
        import time

        self.fd, self.max_bytes, self.deadline, self.clock = fd, max_bytes, deadline, time.monotonic
        self.pos = os.lseek(fd, 0, os.SEEK_CUR)

    def write(self, data):
        # bytes, or a PickleBuffer (protocol 5 hands large arrays over as they are).
        view = memoryview(data).cast("B")
        size = view.nbytes
        if self.pos + size > self.max_bytes:
            raise _OverBound()
        if self.clock() > self.deadline:
            raise _OutOfTime()
        while view:
            n = os.write(self.fd, view)
            self.pos += n
            view = view[n:]
        return size

    def cut(self, pos):
        """Drop what was written after pos (a name that failed)."""
        os.ftruncate(self.fd, pos)
        os.lseek(self.fd, pos, os.SEEK_SET)
        self.pos = pos


def _why_unpicklable(value):
    """What `value` is when it cannot outlive its process (see "State"), else None."""
    import types

    kinds = (
        (types.GeneratorType, "a generator"),
        (types.CoroutineType, "a coroutine"),
        (types.AsyncGeneratorType, "an async generator"),
        (types.FrameType, "a frame"),
        (types.TracebackType, "a traceback"),
        (io.IOBase, "an open file"),
        (type(_thread.allocate_lock()), "a lock"),
        (_thread.RLock, "a lock"),
    )
    for kind, what in kinds:
        if isinstance(value, kind):
            return what
    for module, attr, what in (
        ("socket", "socket", "a socket"),
        ("threading", "Thread", "a thread"),
        ("subprocess", "Popen", "a running process"),
        ("mmap", "mmap", "a memory map"),
        ("asyncio", "Future", "an asyncio task or future"),
        ("asyncio", "AbstractEventLoop", "an event loop"),
    ):
        kind = getattr(sys.modules.get(module), attr, None)
        if isinstance(kind, type) and isinstance(value, kind):
            return what
    return None


def _clip(text):
    text = str(text)
    return text if len(text) <= STATE_NAME_CHARS else text[: STATE_NAME_CHARS - 3] + "..."


def _reported(pairs):
    """At most STATE_MAX_REPORTED [name, why] pairs, clipped, and a last one for the rest."""
    out = [[_clip(n), _clip(w)] for n, w in pairs[:STATE_MAX_REPORTED]]
    if len(pairs) > STATE_MAX_REPORTED:
        out.append(["...", "and %d more" % (len(pairs) - STATE_MAX_REPORTED)])
    return out


def _error_text(e):
    text = "%s: %s" % (type(e).__name__, e) if str(e) else type(e).__name__
    return text.splitlines()[0] if text else type(e).__name__


def reported_error(e):
    """How an error that ended a save or a restore is reported."""
    return _clip(_error_text(e))


def _state_pickler(sink, ns):
    """A cloudpickle pickler whose cell functions keep `ns` as their globals (see "State")."""
    import cloudpickle

    marker = {}  # stands for ns among the pickled functions' globals

    class StatePickler(cloudpickle.Pickler):
        def persistent_id(self, obj):
            return "__main__" if obj is marker else None

    pickler = StatePickler(sink, protocol=5)
    refs = getattr(pickler, "globals_ref", None)
    if isinstance(refs, dict):
        # cloudpickle gives the functions sharing one globals dict one new dict; ns's is
        # the marker, which the restore turns into the live namespace.
        refs[id(ns)] = marker
    return pickler


def save_state(ns, path, max_bytes, timeout_ms):
    """Save the globals `ns` to `path` (see "State"); the `state_saved` event's fields."""
    import json
    import time

    deadline = time.monotonic() + max(timeout_ms, 1) / 1000.0
    modules, skipped, names = {}, [], []
    for name, value in list(ns.items()):
        if not isinstance(name, str) or (name.startswith("__") and name.endswith("__")):
            continue
        if isinstance(value, type(sys)):
            if sys.modules.get(value.__name__) is value and value.__name__ != "__main__":
                modules[name] = value.__name__
            else:
                skipped.append((name, "a module that cannot be imported again"))
            continue
        why = _why_unpicklable(value)
        if why is not None:
            skipped.append((name, why))
        else:
            names.append(name)
    answer = {"bytes": 0, "saved": 0, "modules": len(modules), "skipped": None, "error": None}
    if not names and not modules:
        answer["skipped"] = _reported(skipped)
        return answer
    # Room for the index and trailer, so that the whole file stays within max_bytes.
    reserve = 256 + sum(len(json.dumps(n)) + 48 for n in names) + len(json.dumps(modules))
    if reserve >= max_bytes:
        answer["error"] = "the saved state may hold only %d bytes" % max_bytes
        answer["skipped"] = _reported(skipped)
        return answer
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, STATE_MAGIC)  # short: written whole
        sink = _StateSink(fd, max_bytes - reserve, deadline)
        items, pickler = [], None
        for i, name in enumerate(names):
            start = sink.pos
            fresh = pickler is None
            if fresh:
                pickler = _state_pickler(sink, ns)
            try:
                pickler.dump(ns[name])
            except _OutOfTime:
                sink.cut(start)
                late = "not saved: the save took longer than %d ms" % timeout_ms
                skipped.extend((n, late) for n in names[i:])
                break
            except _OverBound:
                sink.cut(start)
                pickler = None
                skipped.append((name, "too large: the saved state may hold %d bytes" % max_bytes))
                continue
            except OSError as e:  # /tmp is full
                sink.cut(start)
                late = "not saved: %s" % _error_text(e)
                skipped.extend((n, late) for n in names[i:])
                break
            except BaseException as e:  # whatever its __reduce__ raises, the save goes on
                sink.cut(start)
                pickler = None
                skipped.append((name, "cannot be pickled: %s" % _error_text(e)))
                continue
            items.append([name, start, sink.pos, fresh])
        pickler = None
        index = json.dumps({
            "python": "%d.%d" % sys.version_info[:2],
            "modules": modules,
            "items": items,
        }).encode()
        at = sink.pos
        # Within the reserve; written whatever the clock says, as they make the file usable.
        sink.max_bytes, sink.deadline = max_bytes, float("inf")
        sink.write(index)
        sink.write(at.to_bytes(8, "little") + STATE_TRAILER)
        answer.update(bytes=sink.pos, saved=len(items))
    except BaseException:
        os.close(fd)
        fd = None
        try:
            os.unlink(path)
        except OSError:
            pass
        raise
    finally:
        if fd is not None:
            os.close(fd)
    answer["skipped"] = _reported(skipped)
    return answer


class _Window:
    """Reads of one name's bytes in the state file, no further: a corrupt length cannot
    make a load read another name's bytes, or wait."""

    def __init__(self, f):
        self.f, self.end = f, 0

    def set(self, start, end):
        self.f.seek(start)
        self.end = end

    def _left(self, n):
        left = self.end - self.f.tell()
        return max(0, left if n is None or n < 0 else min(n, left))

    def read(self, n=-1):
        return self.f.read(self._left(n))

    def readinto(self, buf):
        view = memoryview(buf).cast("B")
        return self.f.readinto(view[: self._left(view.nbytes)])

    def readline(self, n=-1):
        return self.f.readline(self._left(n))


def _read_state_index(f, size):
    """The index of a state file of `size` bytes, checked; ValueError when it is not one."""
    import json

    if size < len(STATE_MAGIC) + 8 + len(STATE_TRAILER):
        raise ValueError("too short to be a saved state")
    if f.read(len(STATE_MAGIC)) != STATE_MAGIC:
        raise ValueError("not a saved state")
    f.seek(size - 8 - len(STATE_TRAILER))
    tail = f.read(8 + len(STATE_TRAILER))
    if tail[8:] != STATE_TRAILER:
        raise ValueError("the saved state is cut short")
    at = int.from_bytes(tail[:8], "little")
    end = size - len(tail)
    if not len(STATE_MAGIC) <= at <= end or end - at > STATE_MAX_INDEX:
        raise ValueError("the saved state's index is damaged")
    f.seek(at)
    try:
        index = json.loads(f.read(end - at).decode("utf-8"))
    except ValueError:
        raise ValueError("the saved state's index is damaged") from None
    modules = index.get("modules") if isinstance(index, dict) else None
    items = index.get("items") if isinstance(index, dict) else None
    if not isinstance(modules, dict) or not isinstance(items, list):
        raise ValueError("the saved state's index is damaged")
    checked, last = [], len(STATE_MAGIC)
    for item in items:
        ok = (
            isinstance(item, list) and len(item) == 4 and isinstance(item[0], str)
            and all(type(x) is int for x in item[1:3]) and isinstance(item[3], bool)
            and last <= item[1] <= item[2] <= at
        )
        if not ok:
            raise ValueError("the saved state's index is damaged")
        last = item[2]
        checked.append(item)
    modules = [(k, v) for k, v in modules.items() if isinstance(v, str)]
    return index.get("python"), modules, checked


def restore_state(ns, path, max_bytes):
    """Load the state file `path` into the globals `ns` (see "State"); the
    `state_restored` event's fields."""
    import importlib
    import pickle

    answer = {"restored": 0, "failed": None, "error": None}
    failed = []
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        answer["error"] = "cannot open the saved state: %s" % _error_text(e)
        return answer
    with os.fdopen(fd, "rb", buffering=1 << 20) as f:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            answer["error"] = "the saved state has %d bytes, more than the %d allowed" % (size, max_bytes)
            return answer
        try:
            python, modules, items = _read_state_index(f, size)
        except (ValueError, OSError) as e:
            answer["error"] = str(e)
            return answer
        restored = 0
        for name, module in modules:
            if not name.isidentifier():
                continue
            try:
                ns[name] = importlib.import_module(module)
                restored += 1
            except BaseException as e:
                failed.append((name, "cannot import %s: %s" % (module, _error_text(e))))
        window = _Window(f)

        def fresh_unpickler(memo=None):
            u = pickle.Unpickler(window)
            u.persistent_load = lambda pid: ns if pid == "__main__" else _bad_persistent_id(pid)
            if memo:
                u.memo = memo
            return u

        unpickler = None
        for name, start, end, fresh in items:
            if fresh or unpickler is None:
                unpickler = fresh_unpickler()
            window.set(start, end)
            try:
                ns[name] = unpickler.load()
                restored += 1
            except BaseException as e:  # a broken or hostile pickle fails its name only
                why = _error_text(e)
                if python and python != "%d.%d" % sys.version_info[:2]:
                    why += " (saved by Python %s)" % _clip(python)
                failed.append((name, why))
                # A load that failed half-way leaves the unpickler's buffer where it
                # stopped: the next name gets a new one, with what was loaded so far.
                try:
                    memo = unpickler.memo.copy()
                except BaseException:
                    memo = None
                unpickler = fresh_unpickler(memo)
        answer["restored"] = restored
    answer["failed"] = _reported(failed)
    return answer


def _bad_persistent_id(pid):
    import pickle

    raise pickle.UnpicklingError("unknown persistent id")
