"""The workspace boundary: every path a tool touches is resolved here and kept inside the root.

A path is resolved against the workspace root with symlinks followed (realpath), so `..`,
absolute paths and symlinks that lead out of the workspace are refused. Writes are refused
as well under `.git` and northcode's own settings folder (`.northcode`), wherever they sit.
This module does not sandbox shell commands (they run with the user's rights in the
workspace folder); approvals are what gate them.
"""

from __future__ import annotations

import os
from pathlib import Path

PROTECTED_DIRS = (".git", ".northcode")  # never written by a tool, at any depth


class SandboxError(ValueError):
    """A tool asked for a path outside the workspace, or a write to a protected path."""


class Workspace:
    """The folder the agent works in; `resolve` is the only way a tool turns a path into a file."""

    def __init__(self, root: str | os.PathLike, read_only_roots: tuple[os.PathLike, ...] = ()) -> None:
        root_path = Path(root).expanduser()
        if not root_path.is_dir():
            raise ValueError(f"workspace {root_path}: not a directory")
        self.root = Path(os.path.realpath(root_path))
        # folders the tools may read but never write (the shell tool's spilled full outputs)
        self.read_only_roots = tuple(Path(os.path.realpath(r)) for r in read_only_roots)

    def resolve(self, path: str, *, for_write: bool = False) -> Path:
        """The real path of `path` (relative to the root, or absolute inside it), checked."""
        if not isinstance(path, str) or not path.strip():
            raise SandboxError("path: expected a non-empty string")
        if "\x00" in path:
            raise SandboxError(f"path {path!r}: contains a NUL byte")
        candidate = Path(path).expanduser()
        if not candidate.is_absolute():
            candidate = self.root / candidate
        real = Path(os.path.realpath(candidate))  # follows every symlink, also in parents
        if not self.contains(real):
            if not for_write and any(real == r or r in real.parents for r in self.read_only_roots):
                return real
            raise SandboxError(f"path {path!r}: outside the workspace {self.root}")
        if for_write and self.is_protected(real):
            raise SandboxError(f"path {path!r}: {self.protected_part(real)} is protected and never written")
        return real

    def contains(self, real: Path) -> bool:
        return real == self.root or self.root in real.parents

    def relative(self, real: Path) -> str:
        """The path as shown to the model and the user: relative to the root, '/' separated."""
        if not self.contains(real):
            return str(real)  # a read-only root outside the workspace
        rel = real.relative_to(self.root).as_posix()
        return rel if rel else "."

    def is_protected(self, real: Path) -> bool:
        return self.protected_part(real) is not None

    def protected_part(self, real: Path) -> str | None:
        parts = real.relative_to(self.root).parts
        for part in parts:
            if part in PROTECTED_DIRS:
                return part
        return None
