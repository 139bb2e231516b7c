"""The session's todo list: todowrite's argument checked, the summary the model reads, the list from a session."""

from __future__ import annotations

import json

import pytest

from northcode.agent.todos import TodoList, parse_todos

PLAN = [{"content": "read cli.py", "status": "completed", "priority": "high", "id": "1"},
        {"content": "add --verbose", "status": "in_progress", "priority": "medium", "id": "2"},
        {"content": "run the tests", "status": "pending", "priority": "low", "id": "3"}]


def todowrite_call(todos) -> dict:
    arguments = todos if isinstance(todos, str) else json.dumps({"todos": todos})
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "todowrite", "arguments": arguments}}]}


def test_summary_counts_by_status_and_lists_each_item():
    assert TodoList(parse_todos(PLAN)).summary() == (
        "3 todos (1 pending, 1 in progress, 1 completed):\n"
        "[x] read cli.py (id 1, high)\n[~] add --verbose (id 2, medium)\n[ ] run the tests (id 3, low)")
    assert TodoList().summary() == "The todo list is empty."
    assert parse_todos([{"content": " only content "}])[0] == parse_todos(
        [{"content": "only content", "status": "pending", "priority": "medium", "id": "1"}])[0]


@pytest.mark.parametrize(("todos", "message"), [
    ("not a list", "expected an array"),
    ([{"status": "pending"}], r"todos\[0\]: expected an object with a non-empty 'content'"),
    ([{"content": "x", "status": "done"}], r"todos\[0\].status 'done': expected one of pending, in_progress"),
    ([{"content": "x", "priority": "urgent"}], r"todos\[0\].priority 'urgent'"),
])
def test_bad_lists_are_refused_with_what_is_wrong(todos, message):
    with pytest.raises(ValueError, match=message):
        parse_todos(todos)


def test_a_saved_conversation_gives_back_its_last_valid_list():
    messages = [{"role": "user", "content": "plan it"}, todowrite_call(PLAN[:1]), todowrite_call(PLAN),
                todowrite_call([{"content": "x", "status": "bogus"}]), todowrite_call("{not json")]
    assert [todo.id for todo in TodoList.from_messages(messages).items] == ["1", "2", "3"]
    assert TodoList.from_messages([{"role": "system", "content": "hi"}]).items == []
