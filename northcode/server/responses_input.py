"""A /v1/responses body -> the chat body it means, so the Responses API runs the chat path unchanged.

`instructions` becomes the system message; `input` (a string, or message, reasoning, function_call and
function_call_output items) becomes chat messages, the items of one assistant turn (reasoning, then
text, then calls) joined into one assistant message, as the model wrote them; function tools, tool_choice,
reasoning.effort, text.format and max_output_tokens become their chat fields. The chat validation then
runs on that body, and its 400s are renamed back into the Responses fields (input[3], tools[0].name).
Tools that are not functions (web_search, custom, ...) are left out of the prompt, with a log line:
the model can only call functions. Nothing here touches the engine or the tokenizer.
"""

from __future__ import annotations

import functools
import logging
import re

from northcode.server.errors import RequestError

log = logging.getLogger(__name__)

UNSUPPORTED = {"background": "background responses", "conversation": "conversations", "prompt": "prompt templates"}
_TEXT_PARTS = ("input_text", "output_text")
_ASSISTANT_STAGE = {"reasoning": 0, "message": 1, "function_call": 2}  # the order the model writes a turn in
_RENAMED = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens", "reasoning_effort": "reasoning.effort",
            "response_format.json_schema": "text.format", "response_format": "text.format"}


def input_items(value) -> list[dict]:
    """`input` as a list of items (a string is one user message); RequestError for anything else."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise RequestError("input must be a string or an array of input items (objects)", "input")
    return value


def chat_body(body: dict, items: list[tuple[str, dict]]) -> tuple[dict, dict[str, list[str]]]:
    """(the chat body, where each of its messages and tools came from: "input[3]", "tools[1]", ...)."""
    for name, what in UNSUPPORTED.items():
        if body.get(name):
            raise RequestError(f"{name}: {what} are not supported by this server", name)
    if body.get("store") is not None and not isinstance(body["store"], bool):
        raise RequestError("store must be a boolean", "store")
    messages, sources = [], []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError("instructions must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
        sources.append("instructions")
    _add_messages(items, messages, sources)
    tools, tool_sources = chat_tools(body.get("tools"))
    chat = {"messages": messages, "tools": tools, "tool_choice": _tool_choice(body.get("tool_choice")),
            "max_completion_tokens": body.get("max_output_tokens")}
    for name in ("parallel_tool_calls", "temperature", "top_p", "user", "stream"):
        chat[name] = body.get(name)
    chat["reasoning_effort"] = _reasoning_effort(body.get("reasoning"))
    chat["response_format"] = _response_format(body.get("text"))
    return chat, {"messages": sources, "tools": tool_sources}


def in_responses_terms(err: RequestError, sources: dict[str, list[str]]) -> RequestError:
    """A chat validation error named in the fields of the Responses request."""
    def rename(text: str) -> str:
        text = re.sub(r"messages\[(\d+)\]", lambda m: sources["messages"][int(m[1])], text)
        text = re.sub(r"\bmessages\b", "input", text)
        text = re.sub(r"tools\[(\d+)\]\.function", lambda m: sources["tools"][int(m[1])], text)
        for old, new in _RENAMED.items():
            text = re.sub(rf"\b{re.escape(old)}\b", new, text)
        return text

    param = "input" if err.param == "messages" else (rename(err.param) if err.param else None)
    return RequestError(rename(err.message), param, status=err.status, code=err.code, error_type=err.error_type,
                        headers=err.headers)


# --- input items -> messages ---


def _add_messages(items: list[tuple[str, dict]], messages: list[dict], sources: list[str]) -> None:
    turn, stage = None, -1  # the assistant message being assembled, and the stage it has reached
    for param, item in items:
        kind, role = item.get("type", "message"), item.get("role")
        if not isinstance(kind, str):
            raise RequestError(f"{param}.type must be a string (message, reasoning, function_call, ...)", f"{param}.type")
        if kind == "message" and role != "assistant":
            turn = None
            messages.append({"role": role, "content": _content(item.get("content"))})
        elif kind == "function_call_output":
            turn = None
            messages.append({"role": "tool", "tool_call_id": _call_id(item, param), "content": _content(item.get("output"))})
        elif kind in _ASSISTANT_STAGE:
            if turn is None or _ASSISTANT_STAGE[kind] < stage or (_ASSISTANT_STAGE[kind] == stage and kind != "function_call"):
                turn = {"role": "assistant", "content": ""}
                messages.append(turn)
            stage = _ASSISTANT_STAGE[kind]
            _add_to_turn(turn, kind, item, param)
        else:
            raise RequestError(f"{param}.type = {kind!r}: this server takes message, reasoning, function_call and "
                               "function_call_output items", f"{param}.type")
        if len(sources) < len(messages):
            sources.append(param)


def _add_to_turn(turn: dict, kind: str, item: dict, param: str) -> None:
    if kind == "reasoning":
        turn["reasoning_content"] = _reasoning_text(item, param)
    elif kind == "message":
        turn["content"] = _content(item.get("content"))
    else:
        name, arguments = item.get("name"), item.get("arguments", "")
        if not isinstance(name, str) or not name:
            raise RequestError(f"{param}.name must be a non-empty string", f"{param}.name")
        if not isinstance(arguments, str):
            raise RequestError(f"{param}.arguments must be a string (the JSON text of the arguments)", f"{param}.arguments")
        call = {"id": _call_id(item, param), "type": "function", "function": {"name": name, "arguments": arguments}}
        turn.setdefault("tool_calls", []).append(call)


def _content(content):
    """Responses text parts (input_text, output_text) as chat text parts; the chat validation judges the rest."""
    if not isinstance(content, list):
        return content
    return [dict(part, type="text") if isinstance(part, dict) and part.get("type") in _TEXT_PARTS else part for part in content]


def _call_id(item: dict, param: str) -> str:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise RequestError(f"{param}.call_id must be a non-empty string", f"{param}.call_id")
    return call_id


def _reasoning_text(item: dict, param: str) -> str:
    """The reasoning as the model wrote it (content), else its summary; encrypted_content has no meaning here."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise RequestError(f"{param}: content and summary must be arrays of {{\"type\", \"text\"}} parts", param)
    return "".join(p["text"] for p in parts)


# --- tools and options ---


def chat_tools(tools) -> tuple[list[dict] | None, list[str]]:
    """Function tools in the chat shape (those of a namespace too), and the `tools[i]` each came from."""
    if tools is None:
        return None, []
    if not isinstance(tools, list):
        raise RequestError("tools must be an array", "tools")
    out, sources = [], []
    for source, tool, _ in _functions(tools):
        fn = {key: tool[key] for key in ("name", "description", "parameters") if key in tool}
        out.append({"type": "function", "function": fn})
        sources.append(source)
    return out or None, sources


def tool_namespaces(tools) -> dict[str, str]:
    """The namespace of each function that has one (its calls name it), by the function's name."""
    return {tool.get("name"): namespace for _, tool, namespace in _functions(tools or []) if namespace}


def echoed_tools(tools) -> list[dict]:
    """The tools of a request that the model was shown, as the response echoes them."""
    return [t for t in tools or [] if isinstance(t, dict) and t.get("type") in ("function", "namespace")]


def _functions(tools: list):
    """(where it came from, the function tool, its namespace or None) for each function a request offers."""
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise RequestError(f"tools[{i}] must be an object", f"tools[{i}]")
        kind = tool.get("type")
        if not isinstance(kind, str):
            raise RequestError(f"tools[{i}].type must be a string (function, namespace, ...)", f"tools[{i}].type")
        if kind == "function":
            yield f"tools[{i}]", tool, None
        elif kind == "namespace" and isinstance(tool.get("tools"), list):
            for j, inner in enumerate(tool["tools"]):
                if isinstance(inner, dict) and inner.get("type") == "function":
                    yield f"tools[{i}].tools[{j}]", inner, tool.get("name")
        else:
            _left_out(kind)


@functools.lru_cache(maxsize=64)
def _left_out(kind: str) -> None:
    """Said once per tool type a server run meets."""
    log.warning("tools of type %r are left out of the prompt: the model can only call functions", kind)


def _tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if choice is None or isinstance(choice, str):
        return choice
    raise RequestError('tool_choice must be none, auto, required or {"type": "function", "name": ...}', "tool_choice")


def _reasoning_effort(reasoning) -> str | None:
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise RequestError('reasoning must be an object: {"effort": ...}', "reasoning")
    effort = reasoning.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise RequestError("reasoning.effort must be a string", "reasoning.effort")
    return effort


def _response_format(text) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict) or not isinstance(text.get("format", {}), dict):
        raise RequestError('text must be an object: {"format": {"type": ...}}', "text")
    fmt = text.get("format")
    if fmt is None or fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
