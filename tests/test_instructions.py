"""Instruction files: AGENTS.md and CLAUDE.md from the user's folder, the parent folders and the workspace."""

from __future__ import annotations

from northcode.agent.instructions import MAX_CHARS, find_instructions, instructions_prompt
from northcode.agent.loop import system_prompt


def test_the_user_folder_then_parents_then_the_workspace_each_once(tmp_path):
    user, repo = tmp_path / "home", tmp_path / "repo"
    root = repo / "service"
    root.mkdir(parents=True)
    user.mkdir()
    (user / "AGENTS.md").write_text("Answer briefly.\n")
    (repo / "CLAUDE.md").write_text("Use tabs in this repo.\n")
    (root / "AGENTS.md").write_text("Run make test.\n")
    (root / "CLAUDE.md").symlink_to(root / "AGENTS.md")  # the same file: read once
    (repo / "AGENTS.md").write_text("Use tabs in this repo.\n")  # the same text as the folder's CLAUDE.md: once
    found = find_instructions(root, user)
    assert [(f.path, f.text) for f in found] == [(user / "AGENTS.md", "Answer briefly."),
                                                 (repo / "AGENTS.md", "Use tabs in this repo."),
                                                 (root / "AGENTS.md", "Run make test.")]
    prompt = instructions_prompt(found, root)
    assert prompt.index(f"Instructions from {user / 'AGENTS.md'}:") < prompt.index(f"from {repo / 'AGENTS.md'}:")
    assert prompt.endswith("Instructions from AGENTS.md:\n\nRun make test.")  # inside the workspace: relative


def test_the_files_together_are_capped(tmp_path):
    (tmp_path / "AGENTS.md").write_text("a" * (MAX_CHARS + 100))
    (tmp_path / "CLAUDE.md").write_text("b" * 100)
    prompt = instructions_prompt(find_instructions(tmp_path, None), tmp_path)
    assert prompt.count("a") >= MAX_CHARS and "b" not in prompt


def test_the_system_prompt_takes_them_from_northcodes_data_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("NORTHCODE_HOME", str(tmp_path / "data"))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "CLAUDE.md").write_text("Never push.\n")
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "AGENTS.md").write_text("Use pytest.\n")
    prompt = system_prompt(tmp_path / "ws")
    assert prompt.index("Never push.") < prompt.index("Use pytest.") and "the later ones win" in prompt


async def test_the_app_says_which_files_join_the_system_prompt(tmp_path):
    from agent_scripted_endpoint import ScriptedEndpoint
    from test_tui import notices, until

    from northcode.agent.sessions import SessionStore
    from northcode.tui.app import NorthcodeApp

    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "AGENTS.md").write_text("Use pytest.\n")
    store = SessionStore(tmp_path / "sessions.sqlite3")
    with ScriptedEndpoint([]) as endpoint:
        app = NorthcodeApp(tmp_path / "ws", endpoint=endpoint.url, store=store)
        async with app.run_test() as pilot:
            await until(pilot, lambda: app.agent is not None)
            assert "instructions from AGENTS.md join the system prompt" in notices(app)
    store.close()
