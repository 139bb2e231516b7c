"""The read-only search tools: list (a folder tree), glob (files by pattern), grep (regex in files); and the
file list of the app's @ picker.

Walks stay inside the workspace: symlinks are not followed into folders, and a file whose real
path leaves the workspace is skipped. Folders that are noise for a coding agent (.git,
node_modules, virtualenvs, caches) are skipped. Results are capped and say so when cut.
"""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

from northcode.agent.sandbox import Workspace

SKIPPED_DIRS = {".git", "node_modules", "__pycache__", ".venv", "venv", ".mypy_cache", ".pytest_cache",
                ".ruff_cache", ".tox", "dist", "build", ".northcode"}
MAX_LIST_ENTRIES = 300
MAX_GLOB_RESULTS = 100
MAX_GREP_MATCHES = 100
MAX_GREP_LINE_CHARS = 300
MAX_PICKER_FILES = 20_000


def walk_files(workspace: Workspace, top: Path) -> Iterator[Path]:
    """Every regular file under `top` whose real path is in the workspace, noise folders skipped."""
    for dirpath, dirnames, filenames in os.walk(top):  # followlinks=False: no symlinked folders
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            real = Path(os.path.realpath(path))
            if workspace.contains(real) and real.is_file():
                yield path


def list_tree(workspace: Workspace, top: Path) -> str:
    lines: list[str] = [f"{workspace.relative(top)}/"]
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        depth = len(Path(dirpath).relative_to(top).parts)
        indent = "  " * (depth + 1)
        if depth:
            lines.append("  " * depth + Path(dirpath).name + "/")
        lines += [indent + name for name in sorted(filenames)]
        if len(lines) > MAX_LIST_ENTRIES:
            return "\n".join(lines[:MAX_LIST_ENTRIES] + [f"... (cut at {MAX_LIST_ENTRIES} entries; list a subfolder)"])
    return "\n".join(lines)


def glob_files(workspace: Workspace, top: Path, pattern: str) -> str:
    """Files matching `pattern` (`**` crosses folders), newest first, as workspace-relative paths."""
    matches = [p for p in walk_files(workspace, top) if _glob_match(p.relative_to(top).as_posix(), pattern)]
    matches.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    if not matches:
        return f"no files match {pattern!r}"
    shown = [workspace.relative(Path(os.path.realpath(p))) for p in matches[:MAX_GLOB_RESULTS]]
    if len(matches) > MAX_GLOB_RESULTS:
        shown.append(f"... ({len(matches) - MAX_GLOB_RESULTS} more; use a narrower pattern)")
    return "\n".join(shown)


def _glob_match(rel: str, pattern: str) -> bool:
    if "/" not in pattern:  # "*.py" matches at any depth, as in ripgrep's --glob
        return fnmatch.fnmatchcase(rel.rsplit("/", 1)[-1], pattern)
    regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*")
    regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
    return re.fullmatch(regex, rel) is not None


def grep_files(workspace: Workspace, top: Path, pattern: str, include: str | None) -> str:
    """Lines matching the regex `pattern` as `path:line: text`, in files matching `include`."""
    try:
        regex = re.compile(pattern)
    except re.error as err:
        raise ValueError(f"pattern {pattern!r}: not a valid regular expression ({err})") from None
    files = [top] if top.is_file() else walk_files(workspace, top)
    hits: list[str] = []
    for path in files:
        if include and not fnmatch.fnmatchcase(path.name, include):
            continue
        for line_idx, line in enumerate(_text_lines(path)):
            if regex.search(line):
                hits.append(f"{workspace.relative(Path(os.path.realpath(path)))}:{line_idx + 1}: {line[:MAX_GREP_LINE_CHARS]}")
                if len(hits) > MAX_GREP_MATCHES:
                    return "\n".join(hits[:MAX_GREP_MATCHES] + [f"... (cut at {MAX_GREP_MATCHES} matches)"])
    return "\n".join(hits) if hits else f"no matches for {pattern!r}"


def _text_lines(path: Path) -> list[str]:
    try:
        data = path.read_bytes()
    except OSError:
        return []
    if b"\x00" in data[:8192]:  # binary file
        return []
    return data.decode("utf-8", errors="replace").splitlines()


def workspace_files(workspace: Workspace) -> list[str]:
    """The workspace's files as relative paths, for the @ picker: git's list in a repository (tracked and
    untracked, .gitignore respected), else a walk that leaves out the noise folders and what the root
    .gitignore names; at most MAX_PICKER_FILES."""
    root = workspace.root
    try:
        done = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=root,
                              capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        done = None
    if done is not None and done.returncode == 0:
        listed = sorted({p for p in done.stdout.decode("utf-8", errors="replace").split("\0") if p})
        return [p for p in listed if (root / p).is_file()][:MAX_PICKER_FILES]  # the index lists deleted files too
    patterns = _gitignore_patterns(root / ".gitignore")
    files: list[str] = []
    for path in walk_files(workspace, root):
        rel = path.relative_to(root).as_posix()
        if not _is_ignored(rel, patterns):
            files.append(rel)
            if len(files) == MAX_PICKER_FILES:
                break
    return files


def _gitignore_patterns(path: Path) -> list[str]:
    """The plain patterns of a .gitignore (negations, which need git's full rules, are left out)."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    return [line.strip() for line in lines if line.strip() and not line.startswith(("#", "!"))]


def _is_ignored(rel: str, patterns: list[str]) -> bool:
    parts = rel.split("/")
    for pattern in patterns:
        folder_only, pattern = pattern.endswith("/"), pattern.strip("/")
        if "/" in pattern:  # anchored at the root: the path or one of its folders
            if any(fnmatch.fnmatchcase("/".join(parts[:n]), pattern) for n in range(1, len(parts) + (not folder_only))):
                return True
        elif any(fnmatch.fnmatchcase(part, pattern) for part in (parts[:-1] if folder_only else parts)):
            return True
    return False
