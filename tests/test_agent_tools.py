"""The agent's tools one by one: arguments, results, diffs, and refusals."""

from __future__ import annotations

import pytest

from northcode.agent.sandbox import Workspace
from northcode.agent.tools import TOOL_SCHEMAS, ToolBox, ToolError


@pytest.fixture
def tools(tmp_path):
    root = tmp_path / "ws"
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "a.py").write_text("".join(f"line {i}\n" for i in range(1, 11)))
    (root / "pkg" / "sub" / "b.py").write_text("import os\nTODO = 1\n")
    (root / "notes.md").write_text("TODO: write docs\n")
    (root / "node_modules").mkdir()
    (root / "node_modules" / "x.js").write_text("TODO\n")
    (root / "blob.bin").write_bytes(b"\x00\x01TODO")
    return ToolBox(Workspace(root), tmp_path / "spill")


async def call(tools, name, **args) -> str:
    return await tools.prepare(name, args).execute()


def test_schemas_use_opencode_names():
    names = [t["function"]["name"] for t in TOOL_SCHEMAS]
    assert names == ["read", "list", "glob", "grep", "edit", "write", "bash", "todowrite", "todoread", "webfetch"]
    webfetch = TOOL_SCHEMAS[9]["function"]["parameters"]
    assert webfetch["required"] == ["url"] and webfetch["properties"]["format"]["enum"] == ["markdown", "text", "html"]
    edit = TOOL_SCHEMAS[4]["function"]["parameters"]
    assert edit["required"] == ["filePath", "oldString", "newString"] and "replaceAll" in edit["properties"]
    todo = TOOL_SCHEMAS[7]["function"]["parameters"]["properties"]["todos"]["items"]
    assert todo["required"] == ["content", "status", "priority", "id"]


async def test_todowrite_replaces_the_list_and_todoread_reads_it(tools):
    assert await call(tools, "todoread") == "The todo list is empty."
    written = await call(tools, "todowrite", todos=[{"content": "a", "status": "completed", "priority": "low", "id": "1"}])
    assert written == "1 todos (1 completed):\n[x] a (id 1, low)" == await call(tools, "todoread")
    prepared = tools.prepare("todowrite", {"todos": []})
    assert prepared.kind == "todo" and prepared.preview == "" and prepared.title == "todowrite: 0 todos"
    with pytest.raises(ToolError, match="todos\\[0\\].status 'done'"):
        tools.prepare("todowrite", {"todos": [{"content": "a", "status": "done"}]})


async def test_read_line_ranges(tools):
    assert await call(tools, "read", filePath="pkg/a.py", offset=3, limit=2) == \
        "     3\tline 3\n     4\tline 4\n(lines 3-4 of 10; use offset to read more)"
    assert (await call(tools, "read", filePath="pkg/a.py")).endswith("    10\tline 10")
    for args, message in [({"filePath": "pkg/a.py", "offset": 20}, "has 10 lines"), ({"filePath": "nope"}, "no such file"),
                          ({"filePath": "pkg"}, "is a folder"), ({"filePath": "blob.bin"}, "binary"),
                          ({"filePath": "pkg/a.py", "limit": 0}, "'limit'"), ({}, "missing argument 'filePath'")]:
        with pytest.raises(ToolError, match=message):
            await tools.prepare("read", args).execute()


async def test_list_glob_grep(tools):
    tree = await call(tools, "list")
    assert "pkg/" in tree and "    b.py" in tree and "node_modules" not in tree
    assert sorted((await call(tools, "glob", pattern="**/*.py")).splitlines()) == ["pkg/a.py", "pkg/sub/b.py"]
    assert (await call(tools, "glob", pattern="*.py", path="pkg/sub")) == "pkg/sub/b.py"
    assert "no files match" in await call(tools, "glob", pattern="*.rs")
    assert (await call(tools, "grep", pattern="TODO")).splitlines() == ["notes.md:1: TODO: write docs",
                                                                       "pkg/sub/b.py:2: TODO = 1"]
    assert await call(tools, "grep", pattern=r"^import \w+", include="*.py") == "pkg/sub/b.py:1: import os"
    with pytest.raises(ToolError, match="not a valid regular expression"):
        await call(tools, "grep", pattern="(")


async def test_edit_exact_replacement_with_diff(tools):
    root = tools.workspace.root
    prepared = tools.prepare("edit", {"filePath": "pkg/a.py", "oldString": "line 5\n", "newString": "five\n"})
    assert prepared.kind == "edit" and "-line 5\n+five\n" in prepared.preview
    assert (root / "pkg" / "a.py").read_text().count("line 5") == 1  # nothing written before execute
    await prepared.execute()
    assert (root / "pkg" / "a.py").read_text() == "".join(f"line {i}\n" if i != 5 else "five\n" for i in range(1, 11))
    with pytest.raises(ToolError, match="occurs 2 times"):
        tools.prepare("edit", {"filePath": "pkg/a.py", "oldString": "line 1", "newString": "x"})  # line 1, line 10
    await call(tools, "edit", filePath="pkg/a.py", oldString="line", newString="L", replaceAll=True)
    assert "line" not in (root / "pkg" / "a.py").read_text()
    with pytest.raises(ToolError, match="not found"):
        tools.prepare("edit", {"filePath": "pkg/a.py", "oldString": "zzz", "newString": "x"})


async def test_edit_refuses_when_the_file_changed_after_the_preview(tools):
    prepared = tools.prepare("edit", {"filePath": "notes.md", "oldString": "docs", "newString": "tests"})
    (tools.workspace.root / "notes.md").write_text("TODO: write docs now\n")
    with pytest.raises(ToolError, match="changed since"):
        await prepared.execute()
    assert (tools.workspace.root / "notes.md").read_text() == "TODO: write docs now\n"


async def test_edit_keeps_crlf_line_ends(tools):
    path = tools.workspace.root / "win.txt"
    path.write_bytes(b"a\r\nb\r\n")
    await call(tools, "edit", filePath="win.txt", oldString="b", newString="c")
    assert path.read_bytes() == b"a\r\nc\r\n"


async def test_write_creates_folders_and_shows_a_diff(tools):
    prepared = tools.prepare("write", {"filePath": "new/dir/f.txt", "content": "hi\n"})
    assert prepared.preview.startswith("--- /dev/null\n+++ b/new/dir/f.txt") and "+hi\n" in prepared.preview
    assert (await prepared.execute()).startswith("created new/dir/f.txt")
    assert (tools.workspace.root / "new" / "dir" / "f.txt").read_text() == "hi\n"
    overwrite = tools.prepare("write", {"filePath": "new/dir/f.txt", "content": "bye\n"})
    assert "-hi\n+bye\n" in overwrite.preview


async def test_bash_runs_in_the_workspace_with_exit_code_and_timeout(tools):
    out = await call(tools, "bash", command="pwd; echo err >&2; exit 4")
    assert out.startswith(f"{tools.workspace.root}\nerr\n[exit code 4, ")
    out = await call(tools, "bash", command="sleep 5", timeout=200)
    assert "killed after the 0.2 s timeout" in out
    with pytest.raises(ToolError, match="'timeout'"):
        tools.prepare("bash", {"command": "ls", "timeout": "soon"})


def test_bad_arguments(tools):
    with pytest.raises(ToolError, match="not valid JSON"):
        tools.prepare("read", '{"filePath": ')
    with pytest.raises(ToolError, match="must be a JSON object"):
        tools.prepare("read", "[1]")
    with pytest.raises(ToolError, match="unknown tool 'rm'"):
        tools.prepare("rm", {})
    with pytest.raises(ToolError, match="nothing to change"):
        tools.prepare("edit", {"filePath": "notes.md", "oldString": "a", "newString": "a"})


def test_a_path_the_system_refuses_is_a_tool_error(tools):
    """A file name past NAME_MAX (random weights write them) fails a stat in prepare: the model gets the error
    (the loop turns only ToolError into a result there), the run goes on."""
    long_name = "x" * 300
    cases = [("write", {"filePath": long_name, "content": "y"}), ("edit", {"filePath": long_name, "oldString": "a",
             "newString": "b"}), ("list", {"path": long_name}), ("bash", {"command": "ls", "workdir": long_name})]
    for name, args in cases:
        with pytest.raises(ToolError, match="File name too long"):
            tools.prepare(name, args)


async def test_read_output_is_capped(tools):
    (tools.workspace.root / "big.txt").write_text("x" * 100 + "\n" * 0 + "".join(f"{'y' * 99}\n" for _ in range(3000)))
    out = await call(tools, "read", filePath="big.txt")
    assert len(out) < 52_000 and out.rstrip().endswith("use offset to read more)")
    assert "(lines 1-" in out and "of 3000;" in out


async def test_bash_workdir_stays_in_the_workspace(tools):
    assert (await call(tools, "bash", command="pwd", workdir="pkg/sub")).startswith(f"{tools.workspace.root}/pkg/sub\n")
    assert tools.prepare("bash", {"command": "ls", "workdir": "pkg"}).title == "bash: (in pkg) ls"
    for workdir, message in [("..", "outside the workspace"), ("notes.md", "not a folder")]:
        with pytest.raises(ToolError, match=message):
            tools.prepare("bash", {"command": "ls", "workdir": workdir})


async def test_read_an_empty_file(tools):
    (tools.workspace.root / "empty.txt").write_text("")
    assert await call(tools, "read", filePath="empty.txt") == "(empty.txt is empty)"


def test_the_picker_files_outside_git_leave_out_what_gitignore_names(tmp_path):
    from northcode.agent.file_search import workspace_files

    for rel in ("src/app.py", "build/out.py", "logs/run.log", "src/debug.log", "docs/a/b.md", ".git/HEAD",
                "node_modules/x/index.js", "out/keep.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    (tmp_path / ".gitignore").write_text("# build output\nbuild/\n*.log\n/docs/a\n!src/debug.log\n")
    assert workspace_files(Workspace(tmp_path)) == [".gitignore", "out/keep.txt", "src/app.py"]


async def test_an_edit_applied_with_some_hunks_only(tmp_path):
    before = "".join(f"{n}\n" for n in range(20))
    (tmp_path / "f.txt").write_text(before)
    box = ToolBox(Workspace(tmp_path), tmp_path / "spill")
    after = before.replace("1\n", "one\n", 1).replace("18\n", "eighteen\n")
    call = box.prepare("write", {"filePath": "f.txt", "content": after})
    assert len(call.hunks) == 2 and box.prepare("write", {"filePath": "new.txt", "content": "x"}).execute_hunks is None
    output = await call.execute_hunks(frozenset({1}))
    assert (tmp_path / "f.txt").read_text() == before.replace("18\n", "eighteen\n")
    assert output.startswith("updated f.txt with hunk 2 of 2 only (the user rejected hunk 1)") and "+one\n" in output
    assert box.journal.undo_last_turn() == ["restored f.txt"] and (tmp_path / "f.txt").read_text() == before
