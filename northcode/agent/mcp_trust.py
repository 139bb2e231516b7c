"""Which configured MCP servers may start: the user's own (mcp.json in the data folder) always, a workspace's (its
.mcp.json, opencode.json(c), .northcode/mcp.json: files a cloned repository brings) once the user has approved them.

The user's answer, yes or no, is kept in mcp-trust.json in the data folder, keyed by the workspace's path, for one
fingerprint of those servers' definitions as written: a server added, removed or changed asks again. A disabled
server starts nothing and needs no approval. No UI here: the app asks (tui/mcp.py); `northcode run` only reads.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from northcode.agent.mcp_config import USER_FILE, ServerConfig

TRUST_FILE = "mcp-trust.json"  # in northcode's data folder: {workspace path: {"sha256", "allowed", "at"}}


def needing_approval(configs: list[ServerConfig], user_dir: Path) -> list[ServerConfig]:
    """The enabled servers that a workspace's files configure (not the user's own mcp.json)."""
    user_file = user_dir / USER_FILE
    return [config for config in configs if config.enabled and config.source != user_file]


def fingerprint(configs: list[ServerConfig]) -> str:
    """sha256 of the servers' names and definitions as written, in any order."""
    entries = sorted([config.name, config.definition] for config in configs)
    return hashlib.sha256(json.dumps(entries, ensure_ascii=False).encode()).hexdigest()


def stored_decision(root: Path, configs: list[ServerConfig], user_dir: Path) -> bool | None:
    """True (approved) or False (declined) when the user answered for exactly these servers of `root`; None when
    not asked yet, or asked about other definitions."""
    record = _records(user_dir).get(str(root))
    if not isinstance(record, dict) or record.get("sha256") != fingerprint(configs):
        return None
    return record.get("allowed") is True


def store_decision(root: Path, configs: list[ServerConfig], user_dir: Path, allowed: bool) -> None:
    """Keep the user's answer about these servers of `root` (replacing any earlier one for `root`)."""
    records = _records(user_dir)
    records[str(root)] = {"sha256": fingerprint(configs), "allowed": allowed,
                          "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path = user_dir / TRUST_FILE
    temporary = path.with_name(f".{TRUST_FILE}.{os.getpid()}")
    temporary.write_text(json.dumps(records, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    temporary.replace(path)  # a reader never sees half a file


def describe_config(config: ServerConfig) -> str:
    """What would run: `stdio: COMMAND ARGS (env: NAMES)` or `http: URL (headers: NAMES)`."""
    if config.transport == "stdio":
        extra = f"  (env: {', '.join(config.env)})" if config.env else ""
        return f"stdio: {' '.join(config.command)}{extra}"
    extra = f"  (headers: {', '.join(config.headers)})" if config.headers else ""
    return f"http: {config.url}{extra}"


def servers_named(configs: list[ServerConfig], root: Path) -> str:
    """'MCP server NAME (FILE)', or 'MCP servers A (FILE), B (FILE)', the files shown from the workspace."""
    from northcode.agent.instructions import shown_path

    names = ", ".join(f"{config.name} ({shown_path(config.source, root)})" for config in configs)
    return f"MCP server{'s' if len(configs) > 1 else ''} {names}"


def headless_refusal(configs: list[ServerConfig], root: Path) -> str:
    """What `northcode run` says of the untrusted servers it leaves unstarted, and how to trust them."""
    return (f"{servers_named(configs, root)} not started: this workspace's MCP servers are not approved (approve "
            "them in the app, `northcode` in this workspace, or pass --trust-mcp to start them for this run)")


def _records(user_dir: Path) -> dict:
    try:
        records = json.loads((user_dir / TRUST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, or unreadable: nothing is approved
        return {}
    return records if isinstance(records, dict) else {}
