"""Plan mode and the todo list in the app (issue 23, point 2): read-only planning, the list shown as it changes."""

from __future__ import annotations

from agent_scripted_endpoint import ScriptedEndpoint, text_reply, tool_reply
from test_tui import send, store, until, workspace  # noqa: F401 (store, workspace: fixtures)

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
