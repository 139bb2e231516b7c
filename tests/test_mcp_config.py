"""The MCP server configuration: Claude Code's and OpenCode's shapes, which file wins, ${VAR} expansion, JSONC, and
errors that name the file and the entry."""

from __future__ import annotations

import json

import pytest

from northcode.agent.mcp_config import ServerConfig, load_servers, parse_file


def write(path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))


def test_claude_code_shape(tmp_path):
    write(tmp_path / ".mcp.json", {"mcpServers": {
        "files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "."],
                  "env": {"LOG": "1"}},
        "docs": {"type": "http", "url": "https://example.com/mcp", "headers": {"Authorization": "Bearer x"}},
        "plain": {"type": "stdio", "command": "srv"}}})
    servers, errors = parse_file(tmp_path / ".mcp.json")
    assert errors == []
    files, docs, plain = servers
    assert files == ServerConfig("files", "stdio", tmp_path / ".mcp.json",
                                 ("npx", "-y", "@modelcontextprotocol/server-filesystem", "."), {"LOG": "1"})
    assert (docs.transport, docs.url, dict(docs.headers)) == ("http", "https://example.com/mcp",
                                                             {"Authorization": "Bearer x"})
    assert plain.command == ("srv",) and plain.enabled and plain.start_timeout_s == 30


def test_opencode_shape_with_comments_and_trailing_commas(tmp_path):
    write(tmp_path / "opencode.jsonc", """{
      "$schema": "https://opencode.ai/config.json",  // OpenCode's own keys are left alone
      "model": "local/x",
      /* the servers */
      "mcp": {
        "files": {"type": "local", "command": ["uvx", "mcp-server-git", "--repo", "."],
                  "environment": {"A": "http://not-a-comment"}, "enabled": true, "timeout": 2500,},
        "docs": {"type": "remote", "url": "http://127.0.0.1:9/mcp", "headers": {"K": "v"}, "enabled": false},
      },
    }""")
    (files, docs), errors = parse_file(tmp_path / "opencode.jsonc")
    assert errors == []
    assert files.command == ("uvx", "mcp-server-git", "--repo", ".") and files.transport == "stdio"
    assert dict(files.env) == {"A": "http://not-a-comment"} and files.start_timeout_s == 2.5
    assert docs.transport == "http" and not docs.enabled and dict(docs.headers) == {"K": "v"}


def test_both_shapes_in_one_file_and_the_nearer_file_wins(tmp_path):
    user, root = tmp_path / "home", tmp_path / "project"
    write(user / "mcp.json", {"mcpServers": {"shared": {"command": "user-version"}, "mine": {"command": "m"}}})
    write(root / "opencode.json", {"mcp": {"shared": {"type": "local", "command": ["opencode-version"]}}})
    write(root / ".mcp.json", {"mcpServers": {"a": {"command": "a"}}, "mcp": {"b": {"type": "local", "command": ["b"]}}})
    write(root / ".northcode" / "mcp.json", {"mcpServers": {"shared": {"command": "northcode-version"}}})
    servers, errors = load_servers(root, user)
    assert errors == []
    assert [(s.name, s.command[0]) for s in servers] == [("mine", "m"), ("a", "a"), ("b", "b"),
                                                         ("shared", "northcode-version")]
    assert next(s for s in servers if s.name == "shared").source == root / ".northcode" / "mcp.json"


def test_environment_variables_are_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("MCP_TOKEN", "s3cret")
    monkeypatch.delenv("MCP_UNSET", raising=False)
    write(tmp_path / ".mcp.json", {"mcpServers": {
        "a": {"type": "http", "url": "${MCP_HOST:-http://127.0.0.1:1}/mcp",
              "headers": {"Authorization": "Bearer ${MCP_TOKEN}"}},
        "b": {"command": "srv", "args": ["--key={env:MCP_TOKEN}"]},
        "c": {"command": "srv", "env": {"X": "${MCP_UNSET}"}}}})
    (a, b), errors = parse_file(tmp_path / ".mcp.json")
    assert a.url == "http://127.0.0.1:1/mcp" and a.headers["Authorization"] == "Bearer s3cret"
    assert b.command == ("srv", "--key=s3cret")
    assert errors == [f"{tmp_path / '.mcp.json'}: mcpServers.c: the environment variable MCP_UNSET is not set "
                      "(it is used in '${MCP_UNSET}')"]


@pytest.mark.parametrize("entry, message", [
    ({"args": ["x"]}, '"command" must be a non-empty string'),
    ({"command": "x", "args": "x y"}, '"args" must be a list of strings'),
    ({"command": "x", "env": {"A": 1}}, '"env" must be an object of string values'),
    ({"type": "sse", "url": "http://h/sse"}, "type 'sse': expected \"stdio\" or \"http\" (sse servers are not"),
    ({"type": "http", "url": "ftp://h"}, "\"url\" 'ftp://h': expected an http:// or https:// URL"),
    ("npx x", "expected an object")])
def test_a_wrong_claude_entry_is_named_and_the_others_load(tmp_path, entry, message):
    write(tmp_path / ".mcp.json", {"mcpServers": {"bad": entry, "good": {"command": "ok"}}})
    servers, errors = parse_file(tmp_path / ".mcp.json")
    assert [s.name for s in servers] == ["good"]
    (error,) = errors
    assert error.startswith(f"{tmp_path / '.mcp.json'}: mcpServers.bad: ") and message in error


@pytest.mark.parametrize("entry, message", [
    ({"command": ["x"]}, "type None: expected \"local\" or \"remote\""),
    ({"type": "local", "command": "npx x"}, '"command" must be a list of strings'),
    ({"type": "local", "command": []}, '"command" must be a non-empty list'),
    ({"type": "local", "command": ["x"], "enabled": "yes"}, '"enabled" must be true or false'),
    ({"type": "remote", "url": "http://h", "timeout": 0}, '"timeout" must be a positive number of milliseconds'),
    ({"type": "remote"}, '"url" must be a non-empty string')])
def test_a_wrong_opencode_entry_is_named(tmp_path, entry, message):
    write(tmp_path / "opencode.json", {"mcp": {"bad": entry}})
    servers, errors = parse_file(tmp_path / "opencode.json")
    assert servers == [] and len(errors) == 1
    assert errors[0].startswith(f"{tmp_path / 'opencode.json'}: mcp.bad: ") and message in errors[0]


def test_bad_names_and_bad_files(tmp_path):
    write(tmp_path / ".mcp.json", {"mcpServers": {"my server": {"command": "x"}}, "mcp": ["x"]})
    assert parse_file(tmp_path / ".mcp.json")[1] == [
        f"{tmp_path / '.mcp.json'}: mcpServers.my server: a server name may have only letters, digits, _ and -",
        f"{tmp_path / '.mcp.json'}: \"mcp\" must be an object of server name -> settings"]
    write(tmp_path / "a.json", '{"mcpServers": {"x": {"command": "x"}')
    with pytest.raises(ValueError, match=r"a\.json: not valid JSON \(Expecting ',' delimiter at line 1, column 38\)"):
        parse_file(tmp_path / "a.json")
    write(tmp_path / "b.json", "[1, 2]")
    with pytest.raises(ValueError, match=r"b\.json: expected a JSON object with \"mcpServers\" or \"mcp\""):
        parse_file(tmp_path / "b.json")


def test_a_broken_file_does_not_hide_the_others(tmp_path):
    write(tmp_path / "opencode.json", "{not json")
    write(tmp_path / ".mcp.json", {"mcpServers": {"ok": {"command": "x"}}})
    servers, errors = load_servers(tmp_path, None)
    assert [s.name for s in servers] == ["ok"]
    assert len(errors) == 1 and errors[0].startswith(f"{tmp_path / 'opencode.json'}: not valid JSON")


def test_no_files_no_servers(tmp_path):
    assert load_servers(tmp_path, tmp_path / "home") == ([], [])
