"""`@path` in a prompt: the file's text is attached to the message, fenced, after the prompt.

Only paths inside the workspace (the sandbox's rules) are attached; an `@word` that is not a
file there is left as typed, so e-mail addresses and decorators pass through unchanged.
"""

from __future__ import annotations

import re

from northcode.agent.sandbox import SandboxError, Workspace

MENTION = re.compile(r"(?<![\w@])@([\w./\-]+[\w/])")
MAX_MENTION_BYTES = 100_000


def expand_mentions(text: str, workspace: Workspace) -> tuple[str, list[str]]:
    """The prompt with each mentioned file's text appended, and the workspace paths attached."""
    attached: list[str] = []
    blocks: list[str] = []
    for match in MENTION.finditer(text):
        try:
            path = workspace.resolve(match.group(1))
        except SandboxError:
            continue
        rel = workspace.relative(path)
        if not path.is_file() or rel in attached:
            continue
        data = path.read_bytes()[:MAX_MENTION_BYTES]
        if b"\x00" in data[:8192]:
            continue
        attached.append(rel)
        blocks.append(f"Contents of {rel}:\n```\n{data.decode('utf-8', errors='replace').rstrip()}\n```")
    return ("\n\n".join([text, *blocks]) if blocks else text), attached
