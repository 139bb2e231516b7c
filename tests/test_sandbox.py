"""The workspace boundary and the shell tool's limits: escapes fail, timeouts kill the whole group."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from northcode.agent.sandbox import SandboxError, Workspace
from northcode.agent.shell import MAX_OUTPUT_BYTES, run_shell
from northcode.agent.tools import ToolBox, ToolError


@pytest.fixture
def workspace(tmp_path):
    root = tmp_path / "ws"
    (root / "src").mkdir(parents=True)
    (root / "src" / "a.py").write_text("print('a')\n")
    (tmp_path / "secret.txt").write_text("outside\n")
    return Workspace(root)


def test_relative_paths_inside_resolve(workspace):
    assert workspace.resolve("src/a.py") == workspace.root / "src" / "a.py"
    assert workspace.resolve("src/../src/a.py") == workspace.root / "src" / "a.py"
    assert workspace.resolve(str(workspace.root / "src")) == workspace.root / "src"


@pytest.mark.parametrize("path", ["../secret.txt", "src/../../secret.txt", "/etc/passwd", "~/x", "..", "/"])
def test_escapes_are_refused(workspace, path):
    with pytest.raises(SandboxError, match="outside the workspace"):
        workspace.resolve(path)


def test_symlinks_out_of_the_workspace_are_refused(workspace, tmp_path):
    os.symlink(tmp_path / "secret.txt", workspace.root / "link.txt")
    os.symlink(tmp_path, workspace.root / "linkdir")
    for path in ("link.txt", "linkdir/secret.txt", "linkdir"):
        with pytest.raises(SandboxError, match="outside the workspace"):
            workspace.resolve(path)
    os.symlink(workspace.root / "src" / "a.py", workspace.root / "inner.py")  # a link that stays inside is fine
    assert workspace.resolve("inner.py") == workspace.root / "src" / "a.py"


def test_protected_paths_are_never_written(workspace):
    (workspace.root / ".git").mkdir()
    assert workspace.resolve(".git/config") == workspace.root / ".git" / "config"  # reading is fine
    for path in (".git/config", "src/.git/hooks/pre-commit", ".northcode/settings.json"):
        with pytest.raises(SandboxError, match="protected"):
            workspace.resolve(path, for_write=True)


def test_bad_path_values(workspace):
    for path in ("", "  ", "a\x00b"):
        with pytest.raises(SandboxError):
            workspace.resolve(path)


def test_tools_refuse_escapes_and_change_nothing(workspace, tmp_path):
    os.symlink(tmp_path / "secret.txt", workspace.root / "link.txt")
    tools = ToolBox(workspace, tmp_path / "spill")
    attempts = [("read", {"filePath": "../secret.txt"}), ("read", {"filePath": str(tmp_path / "secret.txt")}),
                ("write", {"filePath": "link.txt", "content": "pwned"}),
                ("edit", {"filePath": "../secret.txt", "oldString": "outside", "newString": "pwned"}),
                ("write", {"filePath": ".git/config", "content": "x"}), ("grep", {"pattern": "x", "path": ".."}),
                ("list", {"path": "/"}), ("glob", {"pattern": "*", "path": "../"})]
    for name, args in attempts:
        with pytest.raises(ToolError):
            tools.prepare(name, args)
    assert (tmp_path / "secret.txt").read_text() == "outside\n"
    assert not (workspace.root / ".git").exists()


async def test_grep_does_not_follow_symlinks_out(workspace, tmp_path):
    os.symlink(tmp_path / "secret.txt", workspace.root / "link.txt")
    os.symlink(tmp_path, workspace.root / "linkdir")
    tools = ToolBox(workspace, tmp_path / "spill")
    assert "no matches" in await tools.prepare("grep", {"pattern": "outside"}).execute()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for init counts as dead
        return f.read().split(")")[-1].split()[0] != "Z"


async def test_shell_timeout_kills_the_process_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    start = time.monotonic()
    result = await run_shell(f"sleep 60 & echo $! > {pid_file}; wait", tmp_path, 0.5, tmp_path / "spill")
    assert result.timed_out and result.exit_code is None
    assert time.monotonic() - start < 5
    child_pid = int(pid_file.read_text())
    for _ in range(50):
        if not _alive(child_pid):
            break
        await asyncio.sleep(0.05)
    assert not _alive(child_pid), "the background child survived the timeout"


async def test_shell_cancel_kills_the_process_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    task = asyncio.create_task(run_shell(f"sleep 60 & echo $! > {pid_file}; wait", tmp_path, 30, tmp_path / "spill"))
    for _ in range(100):
        if pid_file.exists() and pid_file.read_text().strip():
            break
        await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    child_pid = int(pid_file.read_text())
    for _ in range(50):
        if not _alive(child_pid):
            break
        await asyncio.sleep(0.05)
    assert not _alive(child_pid)


async def test_shell_output_is_capped_with_head_tail_and_full_file(tmp_path):
    result = await run_shell("for i in $(seq 1 20000); do echo line$i; done; echo oops >&2; exit 3",
                             tmp_path, 30, tmp_path / "spill")
    assert result.exit_code == 3
    assert len(result.output.encode()) < MAX_OUTPUT_BYTES + 500
    assert result.output.startswith("line1\n") and result.output.rstrip().endswith("oops")  # tail kept
    assert result.full_output_path is not None and "full output in" in result.output
    full = result.full_output_path.read_text()
    assert "line10000\n" in full and full.endswith("oops\n")


async def test_short_shell_output_is_kept_whole(tmp_path):
    result = await run_shell("echo hello; pwd", tmp_path, 10, tmp_path / "spill")
    assert result.output == f"hello\n{tmp_path}\n" and result.exit_code == 0
    assert result.full_output_path is None and not list((tmp_path / "spill").iterdir())
