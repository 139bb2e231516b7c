"""Input and review in the app (issue 23, point 4): the prompt history across runs, the command palette, custom
slash commands, the @ file picker, per-hunk review; Pilot against the scripted endpoint."""

from __future__ import annotations

from agent_scripted_endpoint import ScriptedEndpoint, text_reply
from test_tui import notices, send, until, workspace  # noqa: F401 (workspace: a fixture)

from northcode.tui.app import NorthcodeApp
from northcode.tui.widgets import PromptInput


async def test_the_prompt_history_is_kept_across_runs(workspace, store):
    with ScriptedEndpoint([text_reply("one")]) as endpoint:
        first = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with first.run_test() as pilot:
            await until(pilot, lambda: first.agent is not None)
            await send(first, pilot, "from the first run")
            await until(pilot, lambda: endpoint.finished == 1 and not first.is_busy)
        second = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with second.run_test() as pilot:
            await until(pilot, lambda: second.agent is not None)
            await pilot.press("up")
            assert second.query_one(PromptInput).text == "from the first run"


async def test_the_command_palette_offers_the_apps_commands(workspace, store):
    from northcode.agent.approvals import Mode

    with ScriptedEndpoint([]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: app.agent is not None)
            titles = [command.title for command in app.get_system_commands(app.screen)]
            assert {"/compact", "/undo", "/sessions", "/mode full-auto", "/model scripted-model"} <= set(titles)
            await pilot.press("ctrl+p")
            await pilot.press(*"mode full")
            await pilot.pause(0.3)
            await pilot.press("enter")
            await until(pilot, lambda: app.approvals.mode is Mode.FULL_AUTO)
            assert app.focused is app.query_one(PromptInput)


async def test_a_custom_command_sends_its_prompt_and_is_listed(workspace, store):
    from northcode.tui.screens import HelpScreen

    commands = workspace / ".northcode" / "commands"
    commands.mkdir(parents=True)
    (commands / "review.md").write_text("---\ndescription: look for bugs\n---\nReview $ARGUMENTS for bugs.\n")
    with ScriptedEndpoint([text_reply("none found")]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with app.run_test(size=(100, 40)) as pilot:
            await until(pilot, lambda: app.agent is not None)
            assert "/review" in [command.title for command in app.get_system_commands(app.screen)]
            await send(app, pilot, "/review app.py")
            await until(pilot, lambda: endpoint.finished == 1 and not app.is_busy)
            await send(app, pilot, "/reveiw")
            await pilot.pause(0.1)
            assert any("unknown command /reveiw" in n and n.endswith("/quit /review") for n in notices(app))
            await pilot.press("f1")
            await until(pilot, lambda: isinstance(app.screen, HelpScreen))
            assert "| /review | look for bugs (custom) |" in app.screen.query_one("Markdown").source
    assert endpoint.requests[0]["messages"][-1]["content"] == "Review app.py for bugs."


async def test_the_at_picker_fuzzy_matches_the_workspaces_files_and_leaves_out_the_ignored(workspace, store):
    import subprocess

    from northcode.tui.file_picker import FilePicker

    for rel in ("northcode/tui/app.py", "northcode/server/app.py", "docs/tui.md", "build/tui/app.py"):
        (workspace / rel).parent.mkdir(parents=True, exist_ok=True)
        (workspace / rel).write_text("x\n")
    (workspace / ".gitignore").write_text("build/\n")
    subprocess.run(["git", "init", "-q"], cwd=workspace, check=True)
    with ScriptedEndpoint([text_reply("seen")]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: app.agent is not None)
            picker, prompt = app.query_one(FilePicker), app.query_one(PromptInput)
            await pilot.press(*"look at @tuiap")
            await until(pilot, lambda: picker.display and picker.option_count)
            shown = [picker.get_option_at_index(i).id for i in range(picker.option_count)]
            assert shown[0] == "northcode/tui/app.py" and "build/tui/app.py" not in shown  # .gitignore'd
            await pilot.press("tab")
            assert prompt.text == "look at @northcode/tui/app.py " and not picker.display
            await pilot.press(*"and @ap")
            await until(pilot, lambda: picker.display)
            await pilot.press("escape")  # closes the picker only
            assert not picker.display and prompt.text.endswith("@ap") and app.is_running
            await pilot.press("p")
            assert not picker.display  # closed until this @ ends
            await pilot.press("enter")
            await until(pilot, lambda: endpoint.finished == 1 and not app.is_busy)
            assert any("attached northcode/tui/app.py" in n for n in notices(app))


async def test_an_edit_reviewed_hunk_by_hunk_writes_exactly_the_hunks_taken(workspace, store):
    from agent_scripted_endpoint import tool_reply

    from northcode.tui.screens import ApprovalScreen, HunkReviewScreen

    before = "".join(f"line {n}\n" for n in range(1, 21))
    (workspace / "notes.txt").write_text(before)
    after = before.replace("line 2\n", "line two\n").replace("line 18\n", "line eighteen\n")
    write = ("write", {"filePath": "notes.txt", "content": after})
    with ScriptedEndpoint([tool_reply(write), text_reply("ok")]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with app.run_test(size=(100, 40)) as pilot:
            await until(pilot, lambda: app.agent is not None)
            await send(app, pilot, "rename two lines")
            await until(pilot, lambda: isinstance(app.screen, ApprovalScreen))
            await pilot.press("h")
            await until(pilot, lambda: isinstance(app.screen, HunkReviewScreen))
            await pilot.press("n")  # leave the first hunk out; the second is current now
            await pilot.press("escape")  # back to the prompt, then review again: all taken anew
            await until(pilot, lambda: isinstance(app.screen, ApprovalScreen))
            await pilot.press("h")
            await until(pilot, lambda: isinstance(app.screen, HunkReviewScreen))
            await pilot.press("n", "y", "enter")
            await until(pilot, lambda: endpoint.finished == 2 and not app.is_busy)
    assert (workspace / "notes.txt").read_text() == before.replace("line 18\n", "line eighteen\n")
    result = endpoint.requests[1]["messages"][-1]["content"]
    assert result.startswith("updated notes.txt with hunk 2 of 2 only (the user rejected hunk 1); the file does not "
                             "have these hunks of your write:\n@@ -1,5 +1,5 @@\n")
    assert "-line 2\n+line two\n" in result and "eighteen" not in result
