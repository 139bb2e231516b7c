"""Custom slash commands: Markdown files whose text becomes the prompt, as in OpenCode and Claude Code.

`NAME.md` makes `/NAME`, from the workspace's .northcode/commands/ (and .claude/commands/ and
.opencode/command/, where those agents' users keep theirs) or the user's commands/ in northcode's
data folder. Optional front matter between two `---` lines gives `description: ...`; the rest is
the prompt. `$ARGUMENTS` there becomes what was typed after the name (without one, that text is
appended), `$1` to `$9` its words. The workspace's win over the user's; the built-in commands win
over both. Read at each use, so an edited file counts at once. No UI here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

WORKSPACE_FOLDERS = (".northcode/commands", ".claude/commands", ".opencode/command")
NAME = re.compile(r"[\w-]+")
POSITIONAL = re.compile(r"\$([1-9])")
MAX_FILE_BYTES = 64_000


@dataclass(frozen=True)
class CustomCommand:
    name: str
    description: str
    template: str
    path: Path

    def expand(self, argument: str) -> str:
        """The prompt for `/name argument`."""
        words = argument.split()
        text = POSITIONAL.sub(lambda m: words[int(m.group(1)) - 1] if int(m.group(1)) <= len(words) else "",
                              self.template)
        if "$ARGUMENTS" in text:
            return text.replace("$ARGUMENTS", argument).strip()
        takes_words = POSITIONAL.search(self.template) is not None
        return f"{text.strip()}\n\n{argument}" if argument and not takes_words else text.strip()


def parse_command_file(path: Path) -> CustomCommand:
    """A command from its file: front matter (only `description:` is read), then the prompt."""
    text = path.read_bytes()[:MAX_FILE_BYTES].decode("utf-8", errors="replace")
    description = ""
    front = re.match(r"\A---\s*\n(.*?)\n---\s*\n", text, re.S)
    if front:
        text = text[front.end():]
        for line in front.group(1).splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "description":
                description = value.strip().strip("\"'")
    first_line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return CustomCommand(path.stem, description or first_line[:80], text, path)


def load_commands(root: Path, user_dir: Path | None, reserved: tuple[str, ...] = ()) -> dict[str, CustomCommand]:
    """name -> command, the workspace's over the user's, none named as a `reserved` (built-in) command."""
    folders = [root / folder for folder in WORKSPACE_FOLDERS] + ([user_dir / "commands"] if user_dir else [])
    commands: dict[str, CustomCommand] = {}
    for folder in folders:
        try:
            paths = sorted(folder.glob("*.md"))
        except OSError:
            continue
        for path in paths:
            if NAME.fullmatch(path.stem) and path.stem not in reserved and path.stem not in commands and path.is_file():
                try:
                    commands[path.stem] = parse_command_file(path)
                except OSError:
                    continue
    return commands
