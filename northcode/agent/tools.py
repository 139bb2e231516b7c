"""The agent's tools: OpenAI function schemas and their implementations, named as in OpenCode.

read, list, glob, grep (read-only); edit (exact string replacement), write (edit kind);
bash (shell kind); todowrite, todoread (todo kind: the session's todo list, todos.py; no file
touched); webfetch (fetch kind: one URL, web_fetch.py); mcp__<server>__<tool> (mcp kind: the MCP servers'
tools, mcp_servers.py, offered while their server is ready). `prepare` validates a call's arguments and
the paths it touches *before* anything runs, and computes what the user approves: a unified diff
for edit and write, the command for bash, the URL for webfetch. The prepared call then runs exactly
that change (and refuses if the file changed in between). Errors come back as text for the model, never as exceptions.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from northcode import config
from northcode.agent import file_search, web_fetch
from northcode.agent.edit_journal import EditJournal, FileChange, file_text
from northcode.agent.hunks import Hunk, apply_hunks, diff_hunks
from northcode.agent.mcp_servers import PREFIX as MCP_PREFIX
from northcode.agent.mcp_servers import McpCallError, McpServers
from northcode.agent.sandbox import Workspace
from northcode.agent.shell import run_shell
from northcode.agent.todos import PRIORITIES, STATUSES, TodoList, parse_todos

DEFAULT_READ_LIMIT = 2000  # lines
MAX_READ_LINE_CHARS = 2000
MAX_READ_CHARS = 50_000  # per call, as OpenCode: the model pages through longer files with offset
DEFAULT_BASH_TIMEOUT_MS = 120_000
MAX_BASH_TIMEOUT_MS = 600_000


class ToolError(ValueError):
    """A call the tool cannot run: bad arguments, a path outside the workspace, a missing file."""


def _fn(name: str, description: str, properties: dict, required: list[str]) -> dict:
    params = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


_PATH = {"type": "string", "description": "path relative to the workspace root"}
TOOL_SCHEMAS: list[dict] = [
    _fn("read", "Read a text file; lines are numbered from 1.", {
        "filePath": _PATH,
        "offset": {"type": "integer", "description": "first line to read (1-based)"},
        "limit": {"type": "integer", "description": f"number of lines (default {DEFAULT_READ_LIMIT})"},
    }, ["filePath"]),
    _fn("list", "List the files and folders under a folder, as a tree.", {
        "path": {"type": "string", "description": "folder (default: the workspace root)"},
    }, []),
    _fn("glob", "Find files by glob pattern such as '**/*.py'; newest first.", {
        "pattern": {"type": "string"}, "path": {"type": "string", "description": "folder to search in"},
    }, ["pattern"]),
    _fn("grep", "Search file contents with a regular expression; prints path:line: text.", {
        "pattern": {"type": "string"}, "path": {"type": "string", "description": "folder or file"},
        "include": {"type": "string", "description": "only files whose name matches this glob, e.g. '*.py'"},
    }, ["pattern"]),
    _fn("edit", "Replace an exact string in a file. oldString must occur exactly once unless replaceAll.", {
        "filePath": _PATH, "oldString": {"type": "string"}, "newString": {"type": "string"},
        "replaceAll": {"type": "boolean"},
    }, ["filePath", "oldString", "newString"]),
    _fn("write", "Create or overwrite a file with the given content.", {
        "filePath": _PATH, "content": {"type": "string"},
    }, ["filePath", "content"]),
    _fn("bash", "Run a shell command in the workspace folder; stdout and stderr are returned.", {
        "command": {"type": "string"},
        "timeout": {"type": "integer", "description": f"milliseconds (default {DEFAULT_BASH_TIMEOUT_MS})"},
        "workdir": {"type": "string", "description": "folder to run in (default: the workspace root)"},
        "description": {"type": "string", "description": "what the command does, in a few words"},
    }, ["command"]),
    _fn("todowrite", "Replace the session's todo list (send every item, with its status): plan a multi-step task "
        "and keep its progress up to date, one item in_progress at a time.", {
        "todos": {"type": "array", "description": "the whole updated list", "items": {
            "type": "object", "additionalProperties": False, "required": ["content", "status", "priority", "id"],
            "properties": {
                "content": {"type": "string", "description": "what to do, briefly"},
                "status": {"type": "string", "enum": list(STATUSES)},
                "priority": {"type": "string", "enum": list(PRIORITIES)},
                "id": {"type": "string", "description": "unique among the items"},
            }}},
    }, ["todos"]),
    _fn("todoread", "Read the session's todo list.", {}, []),
    _fn("webfetch", "Fetch a URL (http or https) and return its content; HTML as Markdown by default.", {
        "url": {"type": "string", "description": "The URL to fetch content from"},
        "format": {"type": "string", "enum": list(web_fetch.FORMATS),
                   "description": "The format to return the content in (markdown, text, or html; default markdown)"},
        "timeout": {"type": "integer", "description": f"Optional timeout in seconds (max {web_fetch.MAX_TIMEOUT_S})"},
    }, ["url"]),
]
TOOL_KINDS = {"read": "read", "list": "read", "glob": "read", "grep": "read", "edit": "edit", "write": "edit",
              "bash": "shell", "todowrite": "todo", "todoread": "todo", "webfetch": "fetch"}


@dataclass
class PreparedCall:
    """A validated tool call, ready to be approved and run."""

    name: str
    kind: str  # "read" | "edit" | "shell" | "todo" | "fetch" | "mcp": what approvals decide on
    title: str  # one line for the user: "edit src/app.py", "bash: pytest -q"
    preview: str  # unified diff (edit kind), the command (shell kind), the URL (fetch kind), the arguments as JSON
    # (mcp kind), "" for reads
    execute: Callable[[], Awaitable[str]]
    hunks: list[Hunk] = field(default_factory=list)  # an edit of an existing file: its diff's hunks
    execute_hunks: Callable[[frozenset[int]], Awaitable[str]] | None = None  # the edit with only these hunks
    read_only: bool = False  # an mcp call whose server marks the tool readOnlyHint (plan mode may ask for it)


class ToolBox:
    """The tools bound to one workspace; `spill_dir` keeps the full output of long shell commands; `journal`
    records every file the edit and write tools change (what /undo takes back); `todos` is the session's todo list
    (the agent sets it for its conversation); `allow_private_fetch` lets webfetch reach loopback and private
    addresses (NORTHCODE_ALLOW_PRIVATE_FETCH=1); `mcp` holds the MCP servers whose tools join the built-in ones
    (the UI starts them and sets it)."""

    def __init__(self, workspace: Workspace, spill_dir: Path) -> None:
        self.workspace = workspace
        self.spill_dir = spill_dir
        self.journal = EditJournal()
        self.todos = TodoList()
        self.allow_private_fetch = config.env_allow_private_fetch()
        self.mcp: McpServers | None = None

    def schemas(self) -> list[dict]:
        """The tools for the next request: the built-in ones, then those of the MCP servers ready now."""
        return TOOL_SCHEMAS + (self.mcp.schemas() if self.mcp is not None else [])

    def prepare(self, name: str, arguments: str | dict) -> PreparedCall:
        args = _parse_arguments(name, arguments)
        if name.startswith(MCP_PREFIX):
            return self._prepare_mcp(name, args)
        handler = getattr(self, f"_prepare_{name}", None) if name in TOOL_KINDS else None
        if handler is None:
            raise ToolError(f"unknown tool {name!r}; the tools are: {', '.join(TOOL_KINDS)}")
        try:
            return handler(args)
        except (ValueError, OSError) as err:  # SandboxError; a stat the system refuses (a name too long, no access)
            raise ToolError(str(err)) from None

    # --- read-only tools ---

    def _prepare_read(self, args: dict) -> PreparedCall:
        path = self.workspace.resolve(_str(args, "filePath"))
        offset, limit = _int(args, "offset", 1, minimum=1), _int(args, "limit", DEFAULT_READ_LIMIT, minimum=1)
        rel = self.workspace.relative(path)

        async def execute() -> str:
            if path.is_dir():
                raise ToolError(f"{rel} is a folder; use the list tool")
            lines = _read_text(path, rel).splitlines()
            if not lines:
                return f"({rel} is empty)"
            if offset > len(lines):
                raise ToolError(f"offset {offset}: {rel} has {len(lines)} lines")
            numbered: list[str] = []
            num_chars = 0
            for i, line in enumerate(lines[offset - 1 : offset - 1 + limit]):
                numbered.append(f"{offset + i:6d}\t{line[:MAX_READ_LINE_CHARS]}")
                num_chars += len(numbered[-1]) + 1
                if num_chars > MAX_READ_CHARS:
                    break
            body = "\n".join(numbered)
            end = offset - 1 + len(numbered)
            more = f"\n(lines {offset}-{end} of {len(lines)}; use offset to read more)" if end < len(lines) else ""
            return body + more

        return PreparedCall("read", "read", f"read {rel}", "", execute)

    def _prepare_list(self, args: dict) -> PreparedCall:
        path = self.workspace.resolve(_str(args, "path", "."))
        if not path.is_dir():
            raise ToolError(f"path {args.get('path')!r}: not a folder")
        return self._read_only("list", f"list {self.workspace.relative(path)}",
                               lambda: file_search.list_tree(self.workspace, path))

    def _prepare_glob(self, args: dict) -> PreparedCall:
        pattern, path = _str(args, "pattern"), self.workspace.resolve(_str(args, "path", "."))
        return self._read_only("glob", f"glob {pattern}", lambda: file_search.glob_files(self.workspace, path, pattern))

    def _prepare_grep(self, args: dict) -> PreparedCall:
        pattern, path = _str(args, "pattern"), self.workspace.resolve(_str(args, "path", "."))
        include = _str(args, "include", "", allow_empty=True) or None
        return self._read_only("grep", f"grep {pattern}",
                               lambda: file_search.grep_files(self.workspace, path, pattern, include))

    def _read_only(self, name: str, title: str, run: Callable[[], str]) -> PreparedCall:
        async def execute() -> str:
            try:
                return run()
            except ValueError as err:
                raise ToolError(str(err)) from None

        return PreparedCall(name, "read", title, "", execute)

    # --- edit tools ---

    def _prepare_edit(self, args: dict) -> PreparedCall:
        path = self.workspace.resolve(_str(args, "filePath"), for_write=True)
        old_string, new_string = _str(args, "oldString", allow_empty=True), _str(args, "newString", allow_empty=True)
        replace_all = bool(args.get("replaceAll", False))
        rel = self.workspace.relative(path)
        if old_string == new_string:
            raise ToolError("oldString and newString are the same: nothing to change")
        if old_string == "":  # OpenCode's convention: an empty oldString creates the file
            if path.exists():
                raise ToolError(f"{rel} exists; oldString is empty (use write to overwrite)")
            return self._file_change("edit", path, None, new_string)
        before = _read_text(path, rel)
        count = before.count(old_string)
        if count == 0:
            raise ToolError(f"oldString not found in {rel} (it must match exactly, whitespace included)")
        if count > 1 and not replace_all:
            raise ToolError(f"oldString occurs {count} times in {rel}; add context to make it unique or set replaceAll")
        after = before.replace(old_string, new_string) if replace_all else before.replace(old_string, new_string, 1)
        return self._file_change("edit", path, before, after)

    def _prepare_write(self, args: dict) -> PreparedCall:
        path = self.workspace.resolve(_str(args, "filePath"), for_write=True)
        content = _str(args, "content", allow_empty=True)
        if path.is_dir():
            raise ToolError(f"{self.workspace.relative(path)} is a folder")
        before = _read_text(path, self.workspace.relative(path)) if path.exists() else None
        return self._file_change("write", path, before, content)

    def _file_change(self, name: str, path: Path, before: str | None, after: str) -> PreparedCall:
        rel = self.workspace.relative(path)
        diff = unified_diff(rel, before, after)
        hunks = diff_hunks(before, after) if before is not None else []

        def write(text: str) -> None:
            if file_text(path) != before:
                raise ToolError(f"{rel} changed since this {name} was prepared; read it again")
            missing = tuple(folder for folder in path.parents if not folder.exists())  # deepest first
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(text.encode("utf-8"))  # bytes: keeps CRLF line ends as they were
            self.journal.record(FileChange(path, rel, before, text, missing))

        async def execute() -> str:
            write(after)
            return f"{'created' if before is None else 'updated'} {rel}\n{diff}"

        async def execute_hunks(accepted: frozenset[int]) -> str:
            assert before is not None and accepted, "a review of an existing file's edit, with a hunk accepted"
            write(apply_hunks(before, after, hunks, accepted))
            left_out = [idx for idx in range(len(hunks)) if idx not in accepted]
            taken = ", ".join(str(idx + 1) for idx in sorted(accepted))
            return (f"updated {rel} with hunk {taken} of {len(hunks)} only (the user rejected hunk "
                    f"{', '.join(str(idx + 1) for idx in left_out)}); the file does not have these hunks of your "
                    f"{name}:\n" + "".join(hunks[idx].text for idx in left_out))

        return PreparedCall(name, "edit", f"{name} {rel}", diff, execute, hunks, execute_hunks if hunks else None)

    # --- the todo list ---

    def _prepare_todowrite(self, args: dict) -> PreparedCall:
        todos = parse_todos(args.get("todos"))

        async def execute() -> str:
            self.todos.items = todos
            return self.todos.summary()

        return PreparedCall("todowrite", "todo", f"todowrite: {len(todos)} todos", "", execute)

    def _prepare_todoread(self, args: dict) -> PreparedCall:
        async def execute() -> str:
            return self.todos.summary()

        return PreparedCall("todoread", "todo", "todoread", "", execute)

    # --- the web ---

    def _prepare_webfetch(self, args: dict) -> PreparedCall:
        url = _str(args, "url").strip()
        output_format = _str(args, "format", "markdown")
        if output_format not in web_fetch.FORMATS:
            raise ToolError(f"argument 'format': expected one of {', '.join(web_fetch.FORMATS)}")
        timeout_s = min(_int(args, "timeout", web_fetch.DEFAULT_TIMEOUT_S, minimum=1), web_fetch.MAX_TIMEOUT_S)
        try:
            web_fetch.check_url(httpx.URL(url))
        except httpx.InvalidURL as err:
            raise ToolError(f"{url!r}: not a valid URL ({err})") from None

        async def execute() -> str:
            try:
                return await web_fetch.fetch(url, output_format, timeout_s, self.allow_private_fetch)
            except web_fetch.FetchError as err:
                raise ToolError(str(err)) from None

        return PreparedCall("webfetch", "fetch", f"webfetch: {url}", url, execute)

    # --- MCP servers' tools ---

    def _prepare_mcp(self, name: str, args: dict) -> PreparedCall:
        tool = self.mcp.find(name) if self.mcp is not None else None
        if tool is None:
            raise ToolError(f"unknown tool {name!r}: no MCP server offers it now (its server may have stopped)")
        mcp = self.mcp

        async def execute() -> str:
            try:
                return await mcp.call(tool, args)
            except McpCallError as err:
                raise ToolError(str(err)) from None

        preview = json.dumps(args, indent=2, ensure_ascii=False)
        brief = json.dumps(args, ensure_ascii=False) if args else ""
        title = f"mcp {tool.server}: {tool.name} {brief if len(brief) <= 80 else brief[:79] + '…'}".rstrip()
        return PreparedCall(name, "mcp", title, preview, execute, read_only=tool.read_only)

    # --- shell ---

    def _prepare_bash(self, args: dict) -> PreparedCall:
        command = _str(args, "command")
        timeout_ms = _int(args, "timeout", DEFAULT_BASH_TIMEOUT_MS, minimum=1)
        timeout_s = min(timeout_ms, MAX_BASH_TIMEOUT_MS) / 1000
        workdir = self.workspace.resolve(_str(args, "workdir", "."))
        if not workdir.is_dir():
            raise ToolError(f"workdir {args.get('workdir')!r}: not a folder")
        where = "" if workdir == self.workspace.root else f"(in {self.workspace.relative(workdir)}) "

        async def execute() -> str:
            result = await run_shell(command, workdir, timeout_s, self.spill_dir)
            if result.timed_out:
                status = f"killed after the {timeout_s:g} s timeout (with its child processes)"
            else:
                status = f"exit code {result.exit_code}"
            separator = "" if result.output.endswith("\n") or not result.output else "\n"
            return f"{result.output}{separator}[{status}, {result.duration_s:.1f} s]"

        return PreparedCall("bash", "shell", f"bash: {where}{command}", command, execute)


def unified_diff(rel: str, before: str | None, after: str) -> str:
    lines = difflib.unified_diff((before or "").splitlines(keepends=True), after.splitlines(keepends=True),
                                 fromfile="/dev/null" if before is None else f"a/{rel}", tofile=f"b/{rel}")
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)


def _parse_arguments(name: str, arguments: str | dict) -> dict:
    if isinstance(arguments, dict):
        return arguments
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError as err:
        raise ToolError(f"{name}: arguments are not valid JSON ({err.msg} at char {err.pos})") from None
    if not isinstance(args, dict):
        raise ToolError(f"{name}: arguments must be a JSON object")
    return args


def _str(args: dict, key: str, default: str | None = None, allow_empty: bool = False) -> str:
    value = args.get(key, default)
    if value is None:
        raise ToolError(f"missing argument {key!r}")
    if not isinstance(value, str) or (not value and not allow_empty):
        raise ToolError(f"argument {key!r}: expected a non-empty string")
    return value


def _int(args: dict, key: str, default: int, minimum: int) -> int:
    value = args.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ToolError(f"argument {key!r}: expected an integer >= {minimum}")
    return value


def _read_text(path: Path, rel: str) -> str:
    if not path.exists():
        raise ToolError(f"{rel}: no such file")
    data = path.read_bytes()
    if b"\x00" in data[:8192]:
        raise ToolError(f"{rel}: a binary file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ToolError(f"{rel}: not UTF-8 text") from None
