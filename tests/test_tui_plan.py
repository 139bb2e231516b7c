"""Plan mode and the todo list in the app (issue 23, point 2): read-only planning, the list shown as it changes."""

from __future__ import annotations

from agent_scripted_endpoint import ScriptedEndpoint, text_reply, tool_reply
from test_tui import send, until, workspace  # noqa: F401 (workspace: a fixture)

from northcode.agent.approvals import Mode
from northcode.tui.app import NorthcodeApp
from northcode.tui.screens import ApprovalScreen
from northcode.tui.widgets import StatusLine, TodoPanel, ToolCallView

TODOS = [{"content": "read app.py", "status": "completed", "priority": "high", "id": "1"},
         {"content": "set x to 2", "status": "pending", "priority": "medium", "id": "2"}]
SHOWN = "2 todos (1 pending, 1 completed):\n[x] read app.py (id 1, high)\n[ ] set x to 2 (id 2, medium)"


async def test_plan_mode_shows_the_todo_list_and_refuses_edits_without_asking(workspace, store):
    replies = [tool_reply(("todowrite", {"todos": TODOS}), ("write", {"filePath": "app.py", "content": "x = 2\n"})),
               text_reply("The plan is above.")]
    with ScriptedEndpoint(replies) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: app.agent is not None)
            panel = app.query_one(TodoPanel)
            assert not panel.display
            await send(app, pilot, "/mode plan")
            assert app.approvals.mode is Mode.PLAN and "mode plan" in app.query_one(StatusLine).render_text()
            await send(app, pilot, "plan: set x to 2")
            await until(pilot, lambda: isinstance(app.screen, ApprovalScreen) or (not app.is_busy
                                                                                 and endpoint.finished == 2))
            assert not isinstance(app.screen, ApprovalScreen) and (workspace / "app.py").read_text() == "x = 1\n"
            assert panel.display and str(panel.render()) == SHOWN
            assert [view.has_class("failed") for view in app.query(ToolCallView)] == [False, True]
            session_id = app.session_id
            await send(app, pilot, "/new")
            await until(pilot, lambda: not panel.display)
    assert "plan mode, which is read-only" in endpoint.requests[1]["messages"][-1]["content"]
    with ScriptedEndpoint([]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store, resume=session_id)
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: app.session_id == session_id)
            panel = app.query_one(TodoPanel)
            assert panel.display and str(panel.render()) == SHOWN


def test_a_long_todo_list_shows_the_items_around_the_one_in_progress():
    """At 80x24 the panel has 6 lines: the count, then the item before the one in progress and the ones after,
    with how many are left out above and below (a list of 15 pushed the one in progress off the panel)."""
    from northcode.agent.todos import Todo, TodoList
    from northcode.tui.widgets import todo_lines

    def todos(*statuses: str) -> TodoList:
        return TodoList([Todo(f"step {idx}", status, "low", str(idx)) for idx, status in enumerate(statuses, 1)])

    middle = todos(*["completed"] * 9, "in_progress", *["pending"] * 5)
    assert todo_lines(middle, 6).splitlines() == [
        "15 todos (5 pending, 1 in progress, 9 completed):", "↑ 8 more", "[x] step 9 (id 9, low)",
        "[~] step 10 (id 10, low)", "[ ] step 11 (id 11, low)", "↓ 4 more"]
    assert todo_lines(todos(*["pending"] * 8), 6).splitlines()[1:] == [
        "[ ] step 1 (id 1, low)", "[ ] step 2 (id 2, low)", "[ ] step 3 (id 3, low)", "[ ] step 4 (id 4, low)",
        "↓ 4 more"]
    assert todo_lines(todos(*["completed"] * 8), 6).splitlines()[1:] == [  # nothing left to do: the top
        "[x] step 1 (id 1, low)", "[x] step 2 (id 2, low)", "[x] step 3 (id 3, low)", "[x] step 4 (id 4, low)",
        "↓ 4 more"]
    assert todo_lines(todos(*["completed"] * 7, "in_progress"), 6).splitlines()[1:] == [
        "↑ 4 more", "[x] step 5 (id 5, low)", "[x] step 6 (id 6, low)", "[x] step 7 (id 7, low)",
        "[~] step 8 (id 8, low)"]
    assert todo_lines(todos("pending", "pending"), 6) == todos("pending", "pending").summary()  # short: as it is
