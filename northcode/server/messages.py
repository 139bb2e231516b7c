"""normalize_messages: OpenAI chat messages -> what the chat template reads, or a 400 naming the field.

Text parts are joined (only text is supported), `developer` becomes `system`, tool-call arguments
are parsed from the JSON strings clients send (the template writes objects with tojson), except
that arguments which are not a JSON object (a call cut off by max_tokens, or malformed) stay the
text the model wrote, reasoning sent back under any of its names is kept as reasoning_content,
and every tool result must answer a call of an earlier assistant message. Lenient elsewhere:
tool names need not be in today's tools.
"""

from __future__ import annotations

from northcode.server.errors import RequestError
from northcode.server.request_body import MAX_JSON_DEPTH, check_json_value, loads_strict

ROLES = ("system", "developer", "user", "assistant", "tool")


def normalize_messages(messages: list | None) -> list[dict]:
    if not messages:
        raise RequestError("messages must be a non-empty array", "messages")
    call_ids: set[str] = set()
    out = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{param} must be an object", param)
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(f"{param}.role = {role!r}: must be one of {', '.join(ROLES)}", f"{param}.role")
        normalized = {"role": "system" if role == "developer" else role}
        if role == "tool":
            normalized.update(_tool_message(message, param, call_ids))
        else:
            normalized["content"] = _text_content(message.get("content"), param, allow_none=role == "assistant")
        if role == "assistant":
            normalized.update(_assistant_extras(message, param, call_ids))
        out.append(normalized)
    return out


def _text_content(content, param: str, *, allow_none: bool) -> str:
    if content is None and allow_none:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{param}.content must be a string or an array of text parts", f"{param}.content")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(f"{param}.content[{j}]: only text parts are supported (got {kind!r})", f"{param}.content[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _assistant_extras(message: dict, param: str, call_ids: set[str]) -> dict:
    extras = {}
    for key in ("reasoning_content", "reasoning", "thinking", "tool_plan"):
        if isinstance(message.get(key), str) and message[key]:
            extras["reasoning_content"] = message[key]
            break
    calls = message.get("tool_calls")
    if calls is None:
        return extras
    if not isinstance(calls, list):
        raise RequestError(f"{param}.tool_calls must be an array", f"{param}.tool_calls")
    extras["tool_calls"] = [_tool_call(call, f"{param}.tool_calls[{j}]", call_ids) for j, call in enumerate(calls)]
    return extras


def _tool_call(call, param: str, call_ids: set[str]) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(f"{param} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}", param)
    if not isinstance(call.get("id"), str) or not call["id"]:
        raise RequestError(f"{param}.id must be a non-empty string", f"{param}.id")
    arguments = _call_arguments(fn.get("arguments"), f"{param}.function.arguments")
    call_ids.add(call["id"])
    return {"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": arguments}}


def _call_arguments(arguments, param: str) -> dict | str:
    """A call's arguments as the template renders them.

    A JSON string holding an object is parsed (the template writes it back with tojson, which is
    the spacing the model writes; clients that re-serialize compactly, like the AI SDK, get the
    model's text back too). Any other string is a call the model cut off or wrote malformed, sent
    back verbatim by the client: it stays the string, which the template pastes as it is, so the
    prompt repeats the model's own text (and its tokens still match the prefix cache). A missing,
    null or empty value is a call without arguments. Anything else is a malformed request.
    """
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, dict):
        return arguments
    if not isinstance(arguments, str):
        raise RequestError(f"{param} must be a string (the JSON text of the arguments) or an object, "
                           f"not {type(arguments).__name__}", param)
    try:
        parsed = loads_strict(arguments)
    except RecursionError:
        raise RequestError(f"{param} nests deeper than {MAX_JSON_DEPTH} levels of arrays and objects", param) from None
    except ValueError:
        return arguments
    if not isinstance(parsed, dict):
        return arguments
    check_json_value(parsed, param)  # the text may hold what the body could not (depth, "\ud800" escapes)
    return parsed


def _tool_message(message: dict, param: str, call_ids: set[str]) -> dict:
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise RequestError(f"{param}.tool_call_id must be a non-empty string", f"{param}.tool_call_id")
    if call_id not in call_ids:
        raise RequestError(f"{param}.tool_call_id = {call_id!r} matches no tool call of an earlier assistant message", f"{param}.tool_call_id")
    content = message.get("content")
    if isinstance(content, list):
        _text_content(content, param, allow_none=False)  # validates: text parts only
        content = [{"type": "text", "text": part["text"]} for part in content]
    elif not isinstance(content, str):
        raise RequestError(f"{param}.content must be a string or an array of text parts", f"{param}.content")
    return {"tool_call_id": call_id, "content": content}
