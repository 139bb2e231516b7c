"""/undo's journal: the edit and write tools record what they change, by turn; undo restores a turn's files, or,
when one of them changed since the agent wrote it, touches nothing."""

from __future__ import annotations

import pytest

from northcode.agent.edit_journal import UndoError
from northcode.agent.sandbox import Workspace
from northcode.agent.tools import ToolBox


@pytest.fixture
def tools(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    (root / "app.py").write_text("x = 1\n")
    (root / "crlf.txt").write_bytes(b"a\r\nb\r\n")
    return ToolBox(Workspace(root), tmp_path / "spill")


async def call(tools, name, **args) -> str:
    return await tools.prepare(name, args).execute()


async def test_undo_restores_edits_and_deletes_created_files(tools):
    root = tools.workspace.root
    tools.journal.begin_turn()
    await call(tools, "edit", filePath="app.py", oldString="x = 1", newString="x = 2")
    await call(tools, "edit", filePath="app.py", oldString="x = 2", newString="x = 3")  # the same file twice
    await call(tools, "write", filePath="pkg/sub/new.py", content="y = 1\n")  # two folders made for it
    await call(tools, "edit", filePath="crlf.txt", oldString="a", newString="A")
    assert tools.journal.undo_last_turn() == ["restored app.py", "deleted pkg/sub/new.py", "restored crlf.txt"]
    assert (root / "app.py").read_text() == "x = 1\n" and not (root / "pkg").exists()
    assert (root / "crlf.txt").read_bytes() == b"a\r\nb\r\n"  # byte for byte, line ends included
    with pytest.raises(UndoError, match="nothing to undo"):
        tools.journal.undo_last_turn()


async def test_undo_goes_back_one_turn_at_a_time_past_turns_that_changed_nothing(tools):
    root = tools.workspace.root
    for value in (2, 3):
        tools.journal.begin_turn()
        await call(tools, "edit", filePath="app.py", oldString=f"x = {value - 1}", newString=f"x = {value}")
    tools.journal.begin_turn()  # a turn that only read
    await call(tools, "read", filePath="app.py")
    assert tools.journal.undo_last_turn() == ["restored app.py"]
    assert (root / "app.py").read_text() == "x = 2\n"
    tools.journal.undo_last_turn()
    assert (root / "app.py").read_text() == "x = 1\n"


async def test_a_file_changed_since_stops_the_undo_and_nothing_is_touched(tools):
    root = tools.workspace.root
    tools.journal.begin_turn()
    await call(tools, "edit", filePath="app.py", oldString="x = 1", newString="x = 2")
    await call(tools, "write", filePath="new.py", content="y = 1\n")
    (root / "app.py").write_text("x = 2  # the user's own change\n")
    with pytest.raises(UndoError, match="^not undone: app.py changed since the agent wrote it; no file was touched$"):
        tools.journal.undo_last_turn()
    assert (root / "new.py").read_text() == "y = 1\n"  # not deleted: the undo did nothing
    (root / "new.py").unlink()  # a created file the user deleted counts as changed too
    with pytest.raises(UndoError, match="app.py, new.py changed since the agent wrote them"):
        tools.journal.undo_last_turn()
    (root / "app.py").write_text("x = 2\n")
    (root / "new.py").write_text("y = 1\n")
    assert tools.journal.undo_last_turn() == ["restored app.py", "deleted new.py"]  # back as the agent left them
