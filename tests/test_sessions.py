"""The session store: saved message by message, listed newest first, resumed exactly, deleted."""

from __future__ import annotations

import time

import pytest

from northcode.agent.sessions import SessionStore


def test_messages_round_trip_exactly(store, tmp_path):
    session_id = store.create(tmp_path, "m")
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "fix the bug\nin app.py"},
                {"role": "assistant", "content": "", "reasoning_content": "hmm",
                 "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "read", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "ünïcode ✓"}]
    for message in messages:
        store.append(session_id, message)
    assert store.messages(session_id) == messages
    info = store.info(session_id)
    assert info.title == "fix the bug" and info.num_messages == 4 and info.model == "m"


def test_saved_as_they_happen(store, tmp_path):
    session_id = store.create(tmp_path, "m")
    store.append(session_id, {"role": "user", "content": "one"})
    other = SessionStore(store.path)  # another process reading the same file sees it at once
    assert other.messages(session_id) == [{"role": "user", "content": "one"}]
    other.close()


def test_list_newest_first_and_by_workspace(store, tmp_path):
    first = store.create(tmp_path / "a", "m")
    time.sleep(0.01)
    second = store.create(tmp_path / "b", "m")
    time.sleep(0.01)
    store.append(first, {"role": "user", "content": "later"})
    assert [s.id for s in store.list()] == [first, second]
    assert [s.id for s in store.list(tmp_path / "b")] == [second]
    assert store.info(second).title == "(new session)"


def test_delete_and_unknown_ids(store, tmp_path):
    session_id = store.create(tmp_path, "m")
    store.append(session_id, {"role": "user", "content": "x"})
    store.delete(session_id)
    assert store.list() == []
    assert store.db.execute("SELECT COUNT(*) FROM messages").fetchone() == (0,)
    for call in (store.messages, store.delete, store.info):
        with pytest.raises(ValueError, match="no such session"):
            call(session_id)


def test_default_location_is_the_data_dir():
    from northcode import paths

    store = SessionStore()
    assert store.path.parent == paths.data_dir()
    store.close()


def test_recorder_creates_the_session_with_the_first_user_message(store, tmp_path):
    from northcode.agent.sessions import SessionRecorder

    recorder = SessionRecorder(store, tmp_path, "m")
    recorder.save({"role": "system", "content": "s"})
    assert recorder.session_id is None and store.list() == []
    recorder.save({"role": "user", "content": "hello"})
    recorder.save({"role": "assistant", "content": "hi"})
    assert [m["role"] for m in store.messages(recorder.session_id)] == ["system", "user", "assistant"]
    resumed = SessionRecorder(store, tmp_path, "m", recorder.session_id)
    resumed.save({"role": "user", "content": "more"})
    assert len(store.messages(recorder.session_id)) == 4 and len(store.list()) == 1


def test_a_prompt_taken_back_leaves_no_trace(store, tmp_path):
    from northcode.agent.sessions import SessionRecorder

    system, first = {"role": "system", "content": "s"}, {"role": "user", "content": "first"}
    recorder = SessionRecorder(store, tmp_path, "m")
    recorder.save(system)
    recorder.save(first)
    recorder.retract(1)  # the only prompt failed: no session is left behind, the next prompt starts one
    assert store.list() == [] and recorder.session_id is None
    recorder.save(first)
    recorder.save({"role": "assistant", "content": "one"})
    recorder.save({"role": "user", "content": "second"})
    recorder.retract(3)  # a later prompt failed: only it goes, the title stays
    assert store.messages(recorder.session_id) == [system, first, {"role": "assistant", "content": "one"}]
    assert store.info(recorder.session_id).title == "first"
    recorder.save({"role": "user", "content": "second"})
    assert [m["content"] for m in store.messages(recorder.session_id)] == ["s", "first", "one", "second"]
    with pytest.raises(ValueError, match="no such session"):
        store.truncate("nope", 0)


def test_prompts_are_kept_per_workspace_oldest_first_and_capped(store, tmp_path, monkeypatch):
    monkeypatch.setattr("northcode.agent.sessions.MAX_PROMPTS", 3)
    for text in ("one", "two", "two", "three", "four"):
        store.add_prompt(tmp_path, text)
    store.add_prompt(tmp_path / "other", "elsewhere")
    assert store.prompts(tmp_path) == ["two", "three", "four"]  # "two" once: not twice in a row
    assert store.prompts(tmp_path / "other") == ["elsewhere"]
