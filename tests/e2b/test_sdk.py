"""E2B's own Python SDKs (e2b, e2b-code-interpreter) against codebroker."""

import pytest
from e2b import Sandbox, SandboxQuery
from e2b.exceptions import NotFoundException
from e2b_code_interpreter import Sandbox as CodeSandbox


def test_a_sandbox_is_created_listed_and_killed(broker):
    sbx = Sandbox.create(metadata={"suite": "e2b", "case": "lifecycle"}, timeout=120)
    try:
        info = sbx.get_info()
        assert info.sandbox_id == sbx.sandbox_id
        assert info.state.value == "running"
        assert info.metadata["case"] == "lifecycle"
        assert sbx.is_running()
        listed = Sandbox.list(query=SandboxQuery(metadata={"case": "lifecycle"})).next_items()
        assert [s.sandbox_id for s in listed] == [sbx.sandbox_id]
        sbx.set_timeout(60)
    finally:
        assert sbx.kill() is True
    assert Sandbox.kill(sbx.sandbox_id) is False
    with pytest.raises(Exception) as err:
        Sandbox.get_info(sbx.sandbox_id)
    assert "doesn't exist" in str(err.value) or isinstance(err.value, NotFoundException)


def test_commands_run_with_output_exit_codes_env_and_cwd(broker):
    with Sandbox.create(envs={"FROM_SANDBOX": "s"}) as sbx:
        result = sbx.commands.run("echo hi; echo err >&2")
        assert result.exit_code == 0
        assert result.stdout == "hi\n"
        assert result.stderr == "err\n"
        chunks = []
        result = sbx.commands.run(
            "for i in 1 2 3; do echo line $i; done",
            on_stdout=chunks.append,
        )
        assert "".join(chunks) == "line 1\nline 2\nline 3\n"
        result = sbx.commands.run(
            'echo "$FROM_SANDBOX $FROM_CALL $(pwd)"',
            envs={"FROM_CALL": "c"},
        )
        assert result.stdout == "s c /mnt/data\n"
        sbx.files.make_dir("/home/user/sub")
        result = sbx.commands.run("pwd", cwd="/home/user/sub")
        assert result.stdout.strip() == "/mnt/data/sub"
        from e2b.sandbox.commands.command_handle import CommandExitException
        with pytest.raises(CommandExitException) as failed:
            sbx.commands.run("echo out; exit 3")
        assert failed.value.exit_code == 3
        assert failed.value.stdout == "out\n"


def test_files_are_written_read_listed_and_removed(broker):
    with Sandbox.create() as sbx:
        info = sbx.files.write("/home/user/a.txt", "hello")
        assert info.path == "/home/user/a.txt"
        assert sbx.files.read("/home/user/a.txt") == "hello"
        assert sbx.files.read("a.txt", format="bytes") == b"hello"
        sbx.files.write_files([
            {"path": "/home/user/d/one.txt", "data": "1"},
            {"path": "/home/user/d/two.bin", "data": b"\x00\x01"},
        ])
        names = sorted(e.name for e in sbx.files.list("/home/user/d"))
        assert names == ["one.txt", "two.bin"]
        assert sbx.files.exists("/home/user/d/one.txt")
        assert not sbx.files.exists("/home/user/nope.txt")
        entry = sbx.files.get_info("/home/user/d/two.bin")
        assert entry.size == 2 and entry.type.value == "file"
        # What the code writes is there to read, and what is written the code reads.
        sbx.commands.run("echo from-code > /home/user/made.txt")
        assert sbx.files.read("/home/user/made.txt") == "from-code\n"
        assert sbx.commands.run("cat /mnt/data/a.txt").stdout == "hello"
        moved = sbx.files.rename("/home/user/a.txt", "/home/user/b.txt")
        assert moved.path == "/home/user/b.txt"
        sbx.files.remove("/home/user/b.txt")
        assert not sbx.files.exists("/home/user/b.txt")
        assert sbx.files.make_dir("/home/user/new") is True
        assert sbx.files.make_dir("/home/user/new") is False
        from e2b.exceptions import NotFoundException as FileNotFound
        with pytest.raises(FileNotFound):
            sbx.files.read("/home/user/missing.txt")


def test_code_runs_in_one_kernel_with_logs_results_and_errors(broker):
    with CodeSandbox.create() as sbx:
        first = sbx.run_code("x = 41\nprint('x is', x)")
        assert first.error is None
        assert first.logs.stdout == ["x is 41\n"]
        second = sbx.run_code("x += 1\nprint(x)\nx")
        assert "".join(second.logs.stdout) == "42\n"
        assert second.text == "42"
        assert second.results[0].is_main_result
        failed = sbx.run_code("1/0")
        assert failed.error is not None
        assert failed.error.name == "ZeroDivisionError"
        assert failed.error.value == "division by zero"
        assert "Traceback" in failed.error.traceback
        assert failed.logs.stderr == []
        table = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})")
        assert table.error is None
        assert "<table" in table.results[0].html
        assert "a" in table.text
        text = sbx.run_code("'quoted'")
        assert text.text == "quoted"
        shown = sbx.run_code(
            "class Rich:\n"
            "    def _repr_markdown_(self): return '**bold**'\n"
            "    def _repr_json_(self): return {'k': 1}\n"
            "display(Rich())\n"
            "None"
        )
        assert shown.results[0].markdown == "**bold**"
        assert shown.results[0].json == {"k": 1}
        assert not shown.results[0].is_main_result
        left_open = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([3, 1, 2]);")
        assert left_open.results and left_open.results[0].png
        figure = sbx.run_code(
            "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()"
        )
        assert figure.error is None
        assert any(r.png for r in figure.results), figure
        seen = []
        sbx.run_code("import sys\nprint('out')\nprint('err', file=sys.stderr)",
                     on_stdout=lambda m: seen.append(("out", m.line)),
                     on_stderr=lambda m: seen.append(("err", m.line)))
        assert ("out", "out\n") in seen and ("err", "err\n") in seen
        env = sbx.run_code("import os\nprint(os.environ.get('ONLY_HERE'))", envs={"ONLY_HERE": "yes"})
        assert env.logs.stdout == ["yes\n"]
        after = sbx.run_code("import os\nprint(os.environ.get('ONLY_HERE'))")
        assert after.logs.stdout == ["None\n"]
        bash = sbx.run_code("echo from bash", language="bash")
        assert bash.logs.stdout == ["from bash\n"]


def test_pause_connect_background_commands_and_refusals(broker):
    from e2b.exceptions import AuthenticationException

    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="not-a-key")
    sbx = CodeSandbox.create()
    try:
        sbx.run_code("kept = [1, 2, 3]")
        # A background command runs while the client goes on, and is killed by pid.
        handle = sbx.commands.run("echo started; sleep 60", background=True)
        listed = [p.pid for p in sbx.commands.list()]
        assert handle.pid in listed
        assert sbx.commands.kill(handle.pid) is True
        with pytest.raises(Exception):
            handle.wait()
        assert sbx.commands.kill(handle.pid) is False
        # No network inside the sandbox.
        net = sbx.run_code(
            "import socket\ns = socket.socket()\ns.settimeout(3)\ns.connect(('1.1.1.1', 80))"
        )
        assert net.error is not None and net.error.name in ("OSError", "TimeoutError", "ConnectionRefusedError")
        assert sbx.pause() is True
        info = Sandbox.get_info(sbx.sandbox_id)
        assert info.state.value == "paused"
        # Connecting resumes it, with its Python state.
        again = CodeSandbox.connect(sbx.sandbox_id)
        assert again.run_code("sum(kept)").text == "6"
    finally:
        sbx.kill()


def test_the_async_clients_run_code_and_files(broker):
    import asyncio

    from e2b_code_interpreter import AsyncSandbox

    async def scenario():
        sbx = await AsyncSandbox.create()
        try:
            await sbx.files.write("/home/user/in.txt", "3")
            execution = await sbx.run_code("int(open('in.txt').read()) * 14")
            assert execution.text == "42"
            result = await sbx.commands.run("cat in.txt")
            assert result.stdout == "3"
            assert [e.name for e in await sbx.files.list("/home/user") if e.name == "in.txt"] == ["in.txt"]
        finally:
            await sbx.kill()

    asyncio.run(scenario())


def test_a_command_reads_what_send_stdin_writes_until_close_stdin(broker):
    with Sandbox.create() as sbx:
        handle = sbx.commands.run("read name; echo \"hello $name\"; wc -c", background=True, stdin=True)
        sbx.commands.send_stdin(handle.pid, "codebroker\n")
        sbx.commands.send_stdin(handle.pid, "more bytes")
        sbx.commands.close_stdin(handle.pid)
        result = handle.wait()
        assert result.stdout == "hello codebroker\n10\n"
        # A command started without stdin says so.
        other = sbx.commands.run("sleep 30", background=True)
        with pytest.raises(Exception) as err:
            sbx.commands.send_stdin(other.pid, "x")
        assert "without stdin" in str(err.value)
        other.kill()
