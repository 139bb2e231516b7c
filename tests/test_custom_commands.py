"""Custom slash commands from Markdown files: where they are found, their front matter, their arguments."""

from __future__ import annotations

from northcode.agent.custom_commands import load_commands


def write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_found_in_the_workspace_then_the_users_folder_built_ins_kept(tmp_path):
    root, user = tmp_path / "ws", tmp_path / "user"
    write(root / ".northcode/commands/review.md", "---\ndescription: \"review a file\"\nagent: build\n---\nReview $ARGUMENTS.\n")
    write(root / ".claude/commands/fix.md", "Fix the failing test $1 in $2.")
    write(user / "commands/review.md", "the user's review")  # the workspace's wins
    write(user / "commands/hello.md", "Say hello.\nThen stop.")
    write(user / "commands/new.md", "shadows a built-in: left out")
    write(user / "commands/bad name.md", "not a command name")
    commands = load_commands(root, user, reserved=("new",))
    assert sorted(commands) == ["fix", "hello", "review"]
    assert commands["review"].description == "review a file" and commands["hello"].description == "Say hello."
    assert commands["review"].expand("app.py") == "Review app.py."
    assert commands["fix"].expand("test_x tests/") == "Fix the failing test test_x in tests/."
    assert commands["hello"].expand("") == "Say hello.\nThen stop."
    assert commands["hello"].expand("in French") == "Say hello.\nThen stop.\n\nin French"  # no $ARGUMENTS: appended
