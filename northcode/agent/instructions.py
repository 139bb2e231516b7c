"""Project instructions for the system prompt: AGENTS.md and CLAUDE.md, from the user's folder down to the workspace.

Read once when a conversation starts (the system prompt never changes within it, so the prefix cache
keeps serving it): the user's own file (northcode's data folder: NORTHCODE_HOME, else the platform's
user data folder), then each folder from the filesystem root down to the workspace root, so the
nearer a file, the later it comes and the more it counts. A CLAUDE.md that is the same file as its
folder's AGENTS.md (a symlink, or the same text) is read once. The whole is capped at MAX_CHARS.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

FILE_NAMES = ("AGENTS.md", "CLAUDE.md")
MAX_CHARS = 32_000  # all the files together


@dataclass(frozen=True)
class Instructions:
    path: Path
    text: str


def find_instructions(root: Path, user_dir: Path | None) -> list[Instructions]:
    """The instruction files that apply to workspace `root`, most general first."""
    folders = ([user_dir] if user_dir is not None else []) + [*reversed(root.parents), root]
    found: list[Instructions] = []
    seen: set[Path] = set()
    for folder in folders:
        texts: set[str] = set()
        for name in FILE_NAMES:
            path = folder / name
            try:
                real = path.resolve()
                if real in seen or not path.is_file():
                    continue
                text = path.read_text(encoding="utf-8", errors="replace").strip()
            except OSError:
                continue
            seen.add(real)
            if text and text not in texts:
                texts.add(text)
                found.append(Instructions(path, text))
    return found


def shown_path(path: Path, root: Path) -> str:
    """`path` relative to the workspace when inside it, else as it is."""
    return str(path.relative_to(root) if path.is_relative_to(root) else path)


def instructions_prompt(found: list[Instructions], root: Path) -> str:
    """The system prompt's part for `found`: each file under its path (shown_path)."""
    parts: list[str] = []
    num_chars = 0
    for item in found:
        text = item.text[: max(MAX_CHARS - num_chars, 0)]
        if not text:
            break
        parts.append(f"Instructions from {shown_path(item.path, root)}:\n\n{text}")
        num_chars += len(text)
    return "\n\n".join(parts)
