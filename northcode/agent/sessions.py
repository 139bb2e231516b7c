"""Saved conversations: one SQLite file in the data directory, written message by message.

A session is a row (id, title, workspace, model, times) and its messages in order, each
stored as the exact JSON sent to the endpoint, so a resumed session repeats the same prompt
prefix (and hits the server's prefix cache). Each message is committed as it is appended:
a crash or a killed terminal loses nothing already shown. The prompts typed in the app are
kept too, per workspace (the last MAX_PROMPTS), so Up finds them in the next run.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from northcode import paths

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY, title TEXT NOT NULL, workspace TEXT NOT NULL, model TEXT NOT NULL,
    created_at REAL NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS messages (
    session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    message_idx INTEGER NOT NULL, body TEXT NOT NULL, PRIMARY KEY (session_id, message_idx));
CREATE TABLE IF NOT EXISTS prompts (
    prompt_idx INTEGER PRIMARY KEY AUTOINCREMENT, workspace TEXT NOT NULL, text TEXT NOT NULL);
"""
MAX_TITLE_CHARS = 60
MAX_PROMPTS = 500  # per workspace, in the prompt history
UNTITLED = "(new session)"


def session_title(text: str) -> str:
    """A session's title: the first line of its first request, cut to MAX_TITLE_CHARS."""
    return text.strip().splitlines()[0][:MAX_TITLE_CHARS] if text.strip() else UNTITLED


@dataclass
class SessionInfo:
    id: str
    title: str
    workspace: str
    model: str
    created_at: float  # seconds since the epoch
    updated_at: float
    num_messages: int


class SessionStore:
    """The session database; `path` defaults to sessions.sqlite3 in the user's data directory."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or paths.data_dir() / "sessions.sqlite3"
        self.db = sqlite3.connect(self.path, check_same_thread=False)
        self.db.execute("PRAGMA foreign_keys = ON")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    def create(self, workspace: Path, model: str, title: str = UNTITLED) -> str:
        """A new session; untitled, it takes its title from its first user message."""
        session_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        now = time.time()
        with self.db:
            self.db.execute("INSERT INTO sessions VALUES (?, ?, ?, ?, ?, ?)",
                            (session_id, title, str(workspace), model, now, now))
        return session_id

    def append(self, session_id: str, message: dict) -> None:
        with self.db:
            (num_messages,) = self.db.execute("SELECT COUNT(*) FROM messages WHERE session_id = ?",
                                              (session_id,)).fetchone()
            self.db.execute("INSERT INTO messages VALUES (?, ?, ?)", (session_id, num_messages, json.dumps(message)))
            self.db.execute("UPDATE sessions SET updated_at = ? WHERE id = ?", (time.time(), session_id))
            if message.get("role") == "user" and isinstance(message.get("content"), str):
                self.db.execute("UPDATE sessions SET title = ? WHERE id = ? AND title = ?",
                                (session_title(message["content"]), session_id, UNTITLED))

    def truncate(self, session_id: str, num_messages: int) -> None:
        """Delete the session's messages from index `num_messages` on (a prompt taken back); a
        session left without a user message is deleted whole."""
        self._require(session_id)
        with self.db:
            self.db.execute("DELETE FROM messages WHERE session_id = ? AND message_idx >= ?", (session_id, num_messages))
            remaining = [json.loads(body) for (body,) in self.db.execute(
                "SELECT body FROM messages WHERE session_id = ?", (session_id,))]
            if not any(m.get("role") == "user" for m in remaining):
                self.db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))

    def messages(self, session_id: str) -> list[dict]:
        self._require(session_id)
        rows = self.db.execute("SELECT body FROM messages WHERE session_id = ? ORDER BY message_idx", (session_id,))
        return [json.loads(body) for (body,) in rows]

    def info(self, session_id: str) -> SessionInfo:
        self._require(session_id)
        return next(s for s in self.list() if s.id == session_id)

    def list(self, workspace: Path | None = None) -> list[SessionInfo]:
        """Sessions, the most recently used first; only those of `workspace` when given."""
        query = ("SELECT s.id, s.title, s.workspace, s.model, s.created_at, s.updated_at, COUNT(m.session_id) "
                 "FROM sessions s LEFT JOIN messages m ON m.session_id = s.id "
                 + ("WHERE s.workspace = ? " if workspace else "") + "GROUP BY s.id ORDER BY s.updated_at DESC")
        rows = self.db.execute(query, (str(workspace),) if workspace else ())
        return [SessionInfo(*row) for row in rows]

    def delete(self, session_id: str) -> None:
        self._require(session_id)
        with self.db:
            self.db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))

    def add_prompt(self, workspace: Path, text: str) -> None:
        """Keep a prompt typed in the app (not twice in a row), the oldest beyond MAX_PROMPTS dropped."""
        if self.prompts(workspace)[-1:] == [text]:
            return
        with self.db:
            self.db.execute("INSERT INTO prompts (workspace, text) VALUES (?, ?)", (str(workspace), text))
            self.db.execute("DELETE FROM prompts WHERE workspace = ? AND prompt_idx NOT IN (SELECT prompt_idx FROM "
                            "prompts WHERE workspace = ? ORDER BY prompt_idx DESC LIMIT ?)",
                            (str(workspace), str(workspace), MAX_PROMPTS))

    def prompts(self, workspace: Path) -> list[str]:
        """The workspace's prompt history, oldest first."""
        rows = self.db.execute("SELECT text FROM prompts WHERE workspace = ? ORDER BY prompt_idx", (str(workspace),))
        return [text for (text,) in rows]

    def _require(self, session_id: str) -> None:
        if self.db.execute("SELECT 1 FROM sessions WHERE id = ?", (session_id,)).fetchone() is None:
            raise ValueError(f"session {session_id!r}: no such session")


class SessionRecorder:
    """Saves one conversation's messages as they are appended; the session row is created with
    the first user message, so starting the app and leaving leaves no empty session behind.
    `title` names a new session whose first user message is not its request (a compacted one)."""

    def __init__(self, store: SessionStore, workspace: Path, model: str, session_id: str | None = None,
                 title: str = UNTITLED) -> None:
        self.store, self.workspace, self.model, self.title = store, workspace, model, title
        self.session_id = session_id
        self.unsaved: list[dict] = []  # messages before the first user message (the system prompt)

    def save(self, message: dict) -> None:
        if self.session_id is not None:
            self.store.append(self.session_id, message)
            return
        self.unsaved.append(message)
        if message.get("role") == "user":
            self.session_id = self.store.create(self.workspace, self.model, self.title)
            for earlier in self.unsaved:
                self.store.append(self.session_id, earlier)
            self.unsaved = []

    def restart(self, messages: list[dict], title: str) -> None:
        """The conversation goes on as `messages` in a new session called `title` (a compacted one: the old
        session keeps the long conversation)."""
        self.session_id, self.unsaved, self.title = None, [], title
        for message in messages:
            self.save(message)

    def retract(self, num_messages: int) -> None:
        """The conversation was cut back to its first `num_messages` messages (see Agent.on_retract)."""
        if self.session_id is None:
            del self.unsaved[num_messages:]
            return
        try:
            kept = self.store.messages(self.session_id)[:num_messages]
            self.store.truncate(self.session_id, num_messages)
        except ValueError:  # the session was deleted meanwhile (from the sessions list)
            self.session_id, self.unsaved = None, []
            return
        if not any(m.get("role") == "user" for m in kept):  # the store deleted the session: start over unsaved
            self.session_id, self.unsaved = None, kept
