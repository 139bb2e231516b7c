"""The session's todo list, written whole by the model's `todowrite` calls and read by `todoread` (OpenCode's tools).

Each call replaces the list (OpenCode's and Claude Code's convention: the model sends every item, with its status),
so the list after a conversation is the one its last valid todowrite call sent: `from_messages` rebuilds it from a
saved session. It lives in memory only; it touches no file, so its calls need no approval.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

STATUSES = ("pending", "in_progress", "completed", "cancelled")
PRIORITIES = ("high", "medium", "low")
MARKS = {"pending": "[ ]", "in_progress": "[~]", "completed": "[x]", "cancelled": "[-]"}
MAX_TODOS = 100


@dataclass(frozen=True, slots=True)
class Todo:
    content: str
    status: str  # one of STATUSES
    priority: str  # one of PRIORITIES
    id: str

    def line(self) -> str:
        return f"{MARKS[self.status]} {self.content} (id {self.id}, {self.priority})"


def parse_todos(value: object) -> list[Todo]:
    """The `todos` argument as Todo items; ValueError that says what is wrong with it (for the model)."""
    if not isinstance(value, list):
        raise ValueError("argument 'todos': expected an array of {content, status, priority, id} objects")
    if len(value) > MAX_TODOS:
        raise ValueError(f"argument 'todos': {len(value)} items, at most {MAX_TODOS}")
    todos: list[Todo] = []
    for idx, item in enumerate(value):
        if not isinstance(item, dict) or not isinstance(item.get("content"), str) or not item["content"].strip():
            raise ValueError(f"todos[{idx}]: expected an object with a non-empty 'content' string")
        status, priority = item.get("status", "pending"), item.get("priority", "medium")
        if status not in STATUSES:
            raise ValueError(f"todos[{idx}].status {status!r}: expected one of {', '.join(STATUSES)}")
        if priority not in PRIORITIES:
            raise ValueError(f"todos[{idx}].priority {priority!r}: expected one of {', '.join(PRIORITIES)}")
        todos.append(Todo(item["content"].strip(), status, priority, str(item.get("id") or idx + 1)))
    return todos


class TodoList:
    """One session's list; `items` is replaced whole by each write."""

    def __init__(self, items: list[Todo] | None = None) -> None:
        self.items: list[Todo] = list(items or [])

    @classmethod
    def from_messages(cls, messages: list[dict]) -> TodoList:
        """The list that a saved conversation's todowrite calls left (invalid ones changed nothing)."""
        todos = cls()
        for message in messages:
            for call in message.get("tool_calls") or []:
                if call.get("function", {}).get("name") != "todowrite":
                    continue
                try:
                    todos.items = parse_todos(json.loads(call["function"]["arguments"]).get("todos"))
                except (ValueError, AttributeError):
                    continue
        return todos

    def summary(self) -> str:
        """The list as the model, the app and `northcode run` see it: a count by status, then one line an item."""
        if not self.items:
            return "The todo list is empty."
        counts = [f"{sum(t.status == s for t in self.items)} {s.replace('_', ' ')}" for s in STATUSES]
        head = f"{len(self.items)} todos ({', '.join(c for c in counts if not c.startswith('0 '))}):"
        return "\n".join([head, *(todo.line() for todo in self.items)])
