"""The agent's own file changes, turn by turn, so that `/undo` can take back a turn's changes, and only when that
is safe.

Each change the edit and write tools make is recorded as (path, before, after), under the turn that made it.
Undo takes back the last turn that changed a file: every file goes back to what it held before that turn, and a
file the turn created is deleted again, with the folders made for it while they are empty. Nothing is undone
unless every one of those files still holds what the agent last wrote there. If a file was changed since (by the
user, an editor or a shell command), undo names it and touches no file. Changes made by shell commands are not
recorded: the journal cannot see them. Undo works without git. Only this process's turns can be undone: a
resumed session starts with an empty journal.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class UndoError(ValueError):
    """Nothing to undo, or a file changed since the agent wrote it (then no file was touched)."""


@dataclass(frozen=True, slots=True)
class FileChange:
    path: Path  # resolved, inside the workspace
    rel: str  # as the user and the model see it
    before: str | None  # None: the change created the file
    after: str
    created_dirs: tuple[Path, ...] = ()  # folders the change made for the file, deepest first


def file_text(path: Path) -> str | None:
    """The file's text as the edit tools compare it (undecodable bytes replaced), or None when there is no file."""
    return path.read_bytes().decode("utf-8", errors="replace") if path.is_file() else None


class EditJournal:
    def __init__(self) -> None:
        self.turns: list[list[FileChange]] = []  # oldest first; a turn that changed nothing is an empty list

    def begin_turn(self) -> None:
        self.turns.append([])

    def record(self, change: FileChange) -> None:
        if not self.turns:
            self.begin_turn()
        self.turns[-1].append(change)

    def undo_last_turn(self) -> list[str]:
        """Restore the files of the last turn that changed any; returns what was done, a line a file
        ("restored app.py", "deleted new.py"). UndoError when there is nothing to undo or a file changed since."""
        while self.turns and not self.turns[-1]:
            self.turns.pop()
        if not self.turns:
            raise UndoError("nothing to undo: the agent has changed no file in this session (shell commands "
                            "are not tracked)")
        changes = self.turns[-1]
        first: dict[Path, FileChange] = {}  # a file's first change of the turn holds what it was before
        last: dict[Path, FileChange] = {}  # and its last one what the agent left there
        for change in changes:
            first.setdefault(change.path, change)
            last[change.path] = change
        moved = [change.rel for path, change in last.items() if file_text(path) != change.after]
        if moved:
            raise UndoError(f"not undone: {', '.join(moved)} changed since the agent wrote "
                            f"{'it' if len(moved) == 1 else 'them'}; no file was touched")
        done = []
        for path, change in first.items():
            if change.before is None:
                path.unlink()
                for folder in change.created_dirs:  # the folders made for it, while nothing else is in them
                    if folder.is_dir() and not any(folder.iterdir()):
                        folder.rmdir()
                done.append(f"deleted {change.rel}")
            else:
                path.write_bytes(change.before.encode("utf-8"))  # bytes: as the tools write (CRLF kept)
                done.append(f"restored {change.rel}")
        self.turns.pop()
        return done
