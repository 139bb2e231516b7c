"""Which MCP servers the agent starts: read from the files Claude Code and OpenCode users already write.

The files, later ones winning by server name: the user's mcp.json in northcode's data folder, then the
workspace's opencode.json, opencode.jsonc, .mcp.json and .northcode/mcp.json. Any file may hold either shape, or
both: "mcpServers" (Claude Code's `.mcp.json`: {command, args, env} for stdio, {type: "http", url, headers} for
streamable HTTP) and "mcp" (OpenCode's: {type: "local", command: [...], environment, enabled, timeout} or
{type: "remote", url, headers, enabled, timeout}). `${VAR}`, `${VAR:-default}` (Claude Code) and `{env:VAR}`
(OpenCode) in strings take the environment's value; comments and trailing commas are allowed (JSONC).
An unreadable file or a wrong entry is an error naming the file and the entry; the rest still load. No connection here.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

WORKSPACE_FILES = ("opencode.json", "opencode.jsonc", ".mcp.json", ".northcode/mcp.json")
USER_FILE = "mcp.json"  # in northcode's data folder
DEFAULT_START_TIMEOUT_S = 30.0  # to connect and list the tools
NAME = re.compile(r"[A-Za-z0-9_-]+")  # what may follow mcp__ in an OpenAI function name
_JSONC = re.compile(r'"(?:\\.|[^"\\])*"|//[^\n]*|/\*.*?\*/|,(?=\s*[}\]])', re.S)
_ENV = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}|\{env:(\w+)\}")


@dataclass(frozen=True)
class ServerConfig:
    name: str
    transport: str  # "stdio" | "http" (streamable HTTP)
    source: Path  # the file that configured it
    command: tuple[str, ...] = ()  # stdio: the program, then its arguments
    env: Mapping[str, str] = field(default_factory=dict)  # stdio: over the agent's own environment
    url: str = ""  # http
    headers: Mapping[str, str] = field(default_factory=dict)  # http
    enabled: bool = True
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    definition: str = field(default="", compare=False)  # the entry as written (JSON, before ${VAR} expansion)


def config_files(root: Path, user_dir: Path | None) -> list[Path]:
    """The files that may configure servers for workspace `root`, the most general first."""
    return ([user_dir / USER_FILE] if user_dir is not None else []) + [root / name for name in WORKSPACE_FILES]


def load_servers(root: Path, user_dir: Path | None) -> tuple[list[ServerConfig], list[str]]:
    """The servers configured for `root` (a later file's entry replaces an earlier one of its name), and the errors."""
    servers: dict[str, ServerConfig] = {}
    errors: list[str] = []
    for path in config_files(root, user_dir):
        if not path.is_file():
            continue
        try:
            found, file_errors = parse_file(path)
        except ValueError as err:
            errors.append(str(err))
            continue
        errors += file_errors
        for server in found:
            servers.pop(server.name, None)
            servers[server.name] = server
    return list(servers.values()), errors


def parse_file(path: Path) -> tuple[list[ServerConfig], list[str]]:
    """The servers of one file and its entries' errors; ValueError when the file as a whole is unusable."""
    try:
        raw = json.loads(_JSONC.sub(lambda m: m.group(0) if m.group(0).startswith('"') else "",
                                    path.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot read it ({err})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object with \"mcpServers\" or \"mcp\"")
    servers: list[ServerConfig] = []
    errors: list[str] = []
    for key, parse_entry in (("mcpServers", _claude_entry), ("mcp", _opencode_entry)):
        entries = raw.get(key, {})
        if not isinstance(entries, dict):
            errors.append(f"{path}: \"{key}\" must be an object of server name -> settings")
            continue
        for name, entry in entries.items():
            where = f"{path}: {key}.{name}"
            try:
                if not NAME.fullmatch(name):
                    raise ValueError("a server name may have only letters, digits, _ and -")
                if not isinstance(entry, dict):
                    raise ValueError("expected an object")
                servers.append(replace(parse_entry(name, entry, path),
                                       definition=json.dumps({key: entry}, sort_keys=True, ensure_ascii=False)))
            except ValueError as err:
                errors.append(f"{where}: {err}")
    return servers, errors


def _claude_entry(name: str, entry: dict, path: Path) -> ServerConfig:
    kind = entry.get("type", "stdio")
    if kind == "stdio":
        command = [_string(entry, "command")] + _strings(entry, "args")
        return ServerConfig(name, "stdio", path, tuple(command), _mapping(entry, "env"))
    if kind in ("http", "streamable-http"):
        return ServerConfig(name, "http", path, url=_url(entry), headers=_mapping(entry, "headers"))
    raise ValueError(f"type {kind!r}: expected \"stdio\" or \"http\" (sse servers are not supported)")


def _opencode_entry(name: str, entry: dict, path: Path) -> ServerConfig:
    kind = entry.get("type")
    enabled = entry.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ValueError("\"enabled\" must be true or false")
    timeout_ms = entry.get("timeout", DEFAULT_START_TIMEOUT_S * 1000)
    if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int | float) or timeout_ms <= 0:
        raise ValueError("\"timeout\" must be a positive number of milliseconds")
    common = {"enabled": enabled, "start_timeout_s": timeout_ms / 1000}
    if kind == "local":
        command = _strings(entry, "command")
        if not command:
            raise ValueError("\"command\" must be a non-empty list of strings: the program, then its arguments")
        return ServerConfig(name, "stdio", path, tuple(command), _mapping(entry, "environment"), **common)
    if kind == "remote":
        return ServerConfig(name, "http", path, url=_url(entry), headers=_mapping(entry, "headers"), **common)
    raise ValueError(f"type {kind!r}: expected \"local\" or \"remote\"")


def expand_env(text: str) -> str:
    """`${VAR}`, `${VAR:-default}` and `{env:VAR}` replaced by the environment's values; ValueError for an unset
    variable without a default."""

    def value(match: re.Match) -> str:
        var = match.group(1) or match.group(3)
        if var in os.environ:
            return os.environ[var]
        if match.group(2) is not None:
            return match.group(2)
        raise ValueError(f"the environment variable {var} is not set (it is used in {text!r})")

    return _ENV.sub(value, text)


def _string(entry: dict, key: str) -> str:
    value = entry.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"\"{key}\" must be a non-empty string")
    return expand_env(value)


def _url(entry: dict) -> str:
    url = _string(entry, "url")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"\"url\" {url!r}: expected an http:// or https:// URL")
    return url


def _strings(entry: dict, key: str) -> list[str]:
    value = entry.get(key, [])
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError(f"\"{key}\" must be a list of strings")
    return [expand_env(item) for item in value]


def _mapping(entry: dict, key: str) -> dict[str, str]:
    value = entry.get(key, {})
    if not isinstance(value, dict) or not all(isinstance(item, str) for item in value.values()):
        raise ValueError(f"\"{key}\" must be an object of string values")
    return {name: expand_env(item) for name, item in value.items()}
