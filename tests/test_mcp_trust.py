"""agent/mcp_trust.py: which servers need the user's approval, the fingerprint of their definitions, and the
answers kept in the data folder."""

from __future__ import annotations

import json
from pathlib import Path

from northcode.agent.mcp_config import load_servers
from northcode.agent.mcp_servers import McpServers
from northcode.agent.mcp_trust import (TRUST_FILE, describe_config, fingerprint, needing_approval, store_decision,
                                       stored_decision)


def configure(tmp_path, workspace_entries: dict, user_entries: dict | None = None):
    root, user_dir = tmp_path / "project", tmp_path / "home"
    root.mkdir(exist_ok=True)
    user_dir.mkdir(exist_ok=True)
    (root / ".mcp.json").write_text(json.dumps({"mcpServers": workspace_entries}))
    if user_entries is not None:
        (user_dir / "mcp.json").write_text(json.dumps({"mcpServers": user_entries}))
    configs, errors = load_servers(root, user_dir)
    assert not errors
    return root, user_dir, configs


def test_only_the_workspaces_enabled_servers_need_approval(tmp_path):
    root, user_dir, configs = configure(tmp_path, {"repo": {"command": "repo-server"}, "shared": {"command": "evil"}},
                                        {"mine": {"command": "my-server"}, "shared": {"command": "good"}})
    (root / "opencode.json").write_text('{"mcp": {"off": {"type": "local", "command": ["x"], "enabled": false}}}')
    configs, _ = load_servers(root, user_dir)
    # a workspace's entry that replaces one of the user's own by name needs approval too
    assert [c.name for c in needing_approval(configs, user_dir)] == ["repo", "shared"]


def test_the_fingerprint_follows_the_definitions_as_written_not_their_order(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKEN", "one")
    _, user_dir, first = configure(tmp_path, {"a": {"command": "x", "args": ["${TOKEN}"]}, "b": {"command": "y"}})
    monkeypatch.setenv("TOKEN", "two")  # the same file: the same fingerprint
    _, _, again = configure(tmp_path, {"b": {"command": "y"}, "a": {"command": "x", "args": ["${TOKEN}"]}})
    _, _, changed = configure(tmp_path, {"a": {"command": "x", "args": ["${TOKEN}", "--all"]}, "b": {"command": "y"}})
    assert fingerprint(first) == fingerprint(again) != fingerprint(changed)
    assert fingerprint(first) != fingerprint(first[:1])  # a server removed


def test_answers_are_kept_per_workspace_and_definitions(tmp_path):
    root, user_dir, configs = configure(tmp_path, {"a": {"command": "x"}})
    assert stored_decision(root, configs, user_dir) is None
    store_decision(root, configs, user_dir, allowed=False)
    assert stored_decision(root, configs, user_dir) is False
    store_decision(root, configs, user_dir, allowed=True)
    assert stored_decision(root, configs, user_dir) is True
    assert stored_decision(tmp_path / "elsewhere", configs, user_dir) is None
    _, _, changed = configure(tmp_path, {"a": {"command": "x", "args": ["-v"]}})
    assert stored_decision(root, changed, user_dir) is None
    (user_dir / TRUST_FILE).write_text("{not json")  # unreadable: nothing is approved
    assert stored_decision(root, configs, user_dir) is None


def test_untrusted_servers_wait_until_trusted(tmp_path):
    root, user_dir, configs = configure(tmp_path, {"a": {"command": "x", "env": {"K": "v"}},
                                                   "web": {"type": "http", "url": "https://example.com/mcp",
                                                           "headers": {"Authorization": "Bearer t"}}})
    servers = McpServers(configs, root, user_dir, untrusted=["a", "web"])
    assert [s.state for s in servers.servers.values()] == ["untrusted", "untrusted"]
    assert [describe_config(c) for c in servers.untrusted()] == [
        "stdio: x  (env: K)", "http: https://example.com/mcp  (headers: Authorization)"]
    servers.trust()
    assert not servers.untrusted() and all(s.state == "starting" and not s.started.is_set()
                                           for s in servers.servers.values())


def test_one_server_is_named_in_the_singular():
    from northcode.agent.mcp_config import ServerConfig
    from northcode.agent.mcp_trust import servers_named

    root = Path("/work/project")
    calc = ServerConfig("calc", "stdio", root / ".mcp.json", ("calc-server",))
    notes = ServerConfig("notes", "stdio", root / "opencode.json", ("notes-server",))
    assert servers_named([calc], root) == "MCP server calc (.mcp.json)"
    assert servers_named([calc, notes], root) == "MCP servers calc (.mcp.json), notes (opencode.json)"
