"""translate_request: an Anthropic Messages body -> the equivalent /v1/chat/completions body, or a 400.

system and text blocks become system/user text, tool_use blocks tool_calls, tool_result blocks tool
messages, thinking blocks reasoning_content, tools and tool_choice their chat forms and `thinking` the
template's reasoning switch; chat's own validation (schemas.py, messages.py) then runs on the result.
Errors name Anthropic's fields (messages[2].content[0].tool_use_id). Nothing here renders or tokenizes.
"""

from __future__ import annotations

from northcode.server.errors import RequestError


def translate_request(body, needs_max_tokens: bool = True) -> tuple[dict, str, bool]:
    """(the equivalent /v1/chat/completions body, the model name to report, stream); RequestError if malformed."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model: a non-empty string is required (any name: the server has one model)", "model")
    max_tokens = body.get("max_tokens")
    if max_tokens is not None or needs_max_tokens:
        if not _is_int(max_tokens) or max_tokens < 1:
            raise RequestError("max_tokens: an integer >= 1 is required", "max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: a non-empty array is required", "messages")
    tools = _tools(body.get("tools"))
    chat = {"model": model, "messages": _system(body.get("system")) + _messages(messages), "max_tokens": max_tokens}
    if tools:
        chat["tools"] = tools
    chat.update(_tool_choice(body.get("tool_choice"), tools))
    reasoning = _thinking(body.get("thinking"), max_tokens)
    if reasoning is not None:
        chat["chat_template_kwargs"] = {"reasoning": reasoning}
    chat.update(_sampling(body))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream must be a boolean", "stream")
    return chat, model, stream


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text_of(blocks: list, param: str) -> list[dict]:
    """Text blocks -> OpenAI text parts (joined without a separator, as the template joins them)."""
    return [_text_part(block, f"{param}[{j}]") for j, block in enumerate(blocks)]


def _text_part(block, where: str) -> dict:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise RequestError(f"{where}: only text blocks are supported here (got {kind!r})", where)
    return {"type": "text", "text": block["text"]}


def _system(system) -> list[dict]:
    if system is None or system == "" or system == []:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if not isinstance(system, list):
        raise RequestError("system must be a string or an array of text blocks", "system")
    return [{"role": "system", "content": _text_of(system, "system")}]


def _messages(messages: list) -> list[dict]:
    out, tool_ids = [], set()
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
            raise RequestError(f"{param}.role must be user, assistant or system", f"{param}.role")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise RequestError(f"{param}.content must be a string or an array of content blocks", f"{param}.content")
        if message["role"] == "system":  # a system turn in the conversation (Claude Code sends them): rendered in place
            out.append({"role": "system", "content": _text_of(content, f"{param}.content")})
        elif message["role"] == "assistant":
            out.append(_assistant(content, f"{param}.content", tool_ids))
        else:
            out += _user(content, f"{param}.content", tool_ids)
    return out


def _block_type(block) -> str | None:
    return block.get("type") if isinstance(block, dict) else None


def _user(blocks: list, param: str, tool_ids: set[str]) -> list[dict]:
    """Runs of text blocks become user messages and tool_result blocks tool messages, in their order."""
    out = []
    for j, block in enumerate(blocks):
        where = f"{param}[{j}]"
        kind = _block_type(block)
        if kind == "tool_result":
            out.append(_tool_result(block, where, tool_ids))
        elif kind == "text":
            if out and out[-1]["role"] == "user":
                out[-1]["content"].append(_text_part(block, where))
            else:
                out.append({"role": "user", "content": [_text_part(block, where)]})
        else:
            raise RequestError(f"{where}: a user turn may hold text and tool_result blocks (got {kind!r}; "
                               "this model reads text only)", where)
    return out or [{"role": "user", "content": ""}]


def _tool_result(block: dict, param: str, tool_ids: set[str]) -> dict:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or call_id not in tool_ids:
        raise RequestError(f"{param}.tool_use_id = {call_id!r} matches no tool_use block of an earlier assistant turn",
                           f"{param}.tool_use_id")
    if not isinstance(block.get("is_error", False), bool | None):
        raise RequestError(f"{param}.is_error must be a boolean", f"{param}.is_error")
    content = block.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        content = _text_of(content, f"{param}.content")
    elif not isinstance(content, str):
        raise RequestError(f"{param}.content must be a string or an array of text blocks", f"{param}.content")
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _assistant(blocks: list, param: str, tool_ids: set[str]) -> dict:
    texts, thinking, calls = [], [], []
    for j, block in enumerate(blocks):
        where, kind = f"{param}[{j}]", _block_type(block)
        if kind == "text":
            texts.append(_text_part(block, where)["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # encrypted by another server: nothing this model can read
        elif kind == "tool_use":
            calls.append(_tool_use(block, where, tool_ids))
        else:
            raise RequestError(f"{where}: an assistant turn may hold text, thinking and tool_use blocks (got {kind!r})", where)
    message = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_use(block: dict, param: str, tool_ids: set[str]) -> dict:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not call_id:
        raise RequestError(f"{param}.id must be a non-empty string", f"{param}.id")
    if not isinstance(name, str) or not name:
        raise RequestError(f"{param}.name must be a non-empty string", f"{param}.name")
    if not isinstance(arguments, dict):
        raise RequestError(f"{param}.input must be an object", f"{param}.input")
    tool_ids.add(call_id)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tools(tools) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError("tools must be an array", "tools")
    out = []
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "custom") not in ("custom", None):
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise RequestError(f"{param}: only client tools (name, description, input_schema) are supported, "
                               f"not {kind!r}", param)
        name, description, schema = tool.get("name"), tool.get("description") or "", tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise RequestError(f"{param}.name must be a non-empty string", f"{param}.name")
        if not isinstance(description, str):
            raise RequestError(f"{param}.description must be a string", f"{param}.description")
        if not isinstance(schema, dict):
            raise RequestError(f"{param}.input_schema must be a JSON schema object", f"{param}.input_schema")
        out.append({"type": "function", "function": {"name": name, "description": description, "parameters": schema}})
    return out


def _tool_choice(choice, tools: list[dict]) -> dict:
    """{auto | any | tool (name) | none, disable_parallel_tool_use} -> tool_choice and parallel_tool_calls."""
    if choice is None:
        return {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise RequestError('tool_choice must be {"type": "auto" | "any" | "tool" | "none"}', "tool_choice.type")
    parallel = choice.get("disable_parallel_tool_use", False)
    if not isinstance(parallel, bool):
        raise RequestError("tool_choice.disable_parallel_tool_use must be a boolean", "tool_choice.disable_parallel_tool_use")
    out = {"parallel_tool_calls": not parallel}
    if kind in ("any", "tool") and not tools:
        raise RequestError(f"tool_choice.type = {kind!r} needs tools", "tool_choice")
    if kind == "tool":
        name = choice.get("name")
        if not any(t["function"]["name"] == name for t in tools):
            raise RequestError(f"tool_choice.name = {name!r} is not one of the tools", "tool_choice.name")
        out["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    return out


def _thinking(thinking, max_tokens: int | None) -> bool | None:
    """enabled / adaptive -> reasoning on, disabled -> off, absent -> the model's default (on)."""
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled":
        return False
    if kind == "adaptive":
        return True
    if kind != "enabled":
        raise RequestError('thinking must be {"type": "enabled", "budget_tokens": N}, {"type": "adaptive"} or '
                           '{"type": "disabled"}', "thinking.type")
    budget = thinking.get("budget_tokens")
    if not _is_int(budget) or budget < 1024:
        raise RequestError("thinking.budget_tokens must be an integer >= 1024", "thinking.budget_tokens")
    if max_tokens is not None and budget >= max_tokens:
        raise RequestError(f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})",
                           "thinking.budget_tokens")
    return True


def _sampling(body: dict) -> dict:
    out = {}
    for name, low, high in (("temperature", 0.0, 1.0), ("top_p", 0.0, 1.0)):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
            raise RequestError(f"{name} must be a number in [{low:g}, {high:g}]", name)
        out[name] = value
    top_k = body.get("top_k")
    if top_k is not None:
        if not _is_int(top_k) or top_k < 0:
            raise RequestError("top_k must be an integer >= 0", "top_k")
        out["top_k"] = top_k
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError("stop_sequences must be an array of non-empty strings", "stop_sequences")
        out["stop"] = stop
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise RequestError("metadata must be an object", "metadata")
    return out
