"""Request validation: the JSON body of /v1/chat/completions and /v1/completions -> typed requests.

Every bad value raises RequestError naming the parameter (a 400 with the OpenAI error body, never
a 500); unknown fields are ignored, as OpenAI-compatible clients pass provider options through.
Messages are normalized by messages.py. Nothing here touches the engine or the tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from northcode.engine.request import SEED_MAX, SEED_MIN, SamplingParams
from northcode.server.chat_template import RESERVED_TEMPLATE_ARGS
from northcode.server.errors import RequestError
from northcode.server.messages import normalize_messages

_MISSING = object()


@dataclass(slots=True)
class GenerationOptions:
    """What both endpoints share: sampling, limits, streaming."""

    sampling: SamplingParams
    max_tokens: int | None  # None: the rest of the context
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass(slots=True)
class ChatRequest:
    messages: list[dict]
    options: GenerationOptions
    tools: list[dict] | None = None  # the tools shown to the model (None: none)
    tool_choice: str | dict = "auto"
    parallel_tool_calls: bool = True
    template_kwargs: dict = field(default_factory=dict)
    response_schema: dict | None = None  # the JSON schema the answer must follow (None: free text)
    tool_params: dict[str, str] = field(default_factory=dict)  # tool name -> where its schema sits in the body


@dataclass(slots=True)
class CompletionRequest:
    prompt: str | list[int]
    options: GenerationOptions
    echo: bool = False


# --- typed field access ---


def _field(body: dict, name: str, kinds: tuple, default=None, *, what: str | None = None,
           int_range: tuple[int, int] = (-(2**63), 2**63 - 1)):
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise RequestError(f"{name} must be {what or _kind_names(kinds)}, got a boolean", name)
    if not isinstance(value, kinds):
        raise RequestError(f"{name} must be {what or _kind_names(kinds)}, got {type(value).__name__}", name)
    low, high = int_range
    if isinstance(value, int) and float not in kinds and not low <= value <= high:
        raise RequestError(f"{name} = {_short(value)}: must be in [{low}, {high}]", name)
    return value


def _kind_names(kinds: tuple) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array", dict: "an object"}
    return " or ".join(names.get(k, k.__name__) for k in kinds if not (k is int and float in kinds))


def _number(body: dict, name: str, default: float) -> float:
    value = _field(body, name, (int, float), default)
    try:
        return float(value)
    except OverflowError:  # an integer past a double's range (JSON numbers have no limit)
        raise RequestError(f"{name} = {_short(value)}: too large for a number", name) from None


def _short(value) -> str:
    """repr(value), cut to a length an error message can carry."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(text)} characters)"


def _require_object(body) -> dict:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None)
    return body


# --- shared options ---


def parse_options(body: dict, *, chat: bool) -> GenerationOptions:
    n = _field(body, "n", (int,), 1)
    if n != 1:
        raise RequestError(f"n = {n}: only n = 1 is supported", "n")
    max_tokens = _field(body, "max_tokens", (int,))
    max_completion = _field(body, "max_completion_tokens", (int,))
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise RequestError("max_tokens and max_completion_tokens disagree; send one of them", "max_completion_tokens")
    limit = max_completion if max_completion is not None else max_tokens
    if limit is not None and limit < 1:
        raise RequestError(f"{'max_completion_tokens' if max_completion is not None else 'max_tokens'} = {limit}: must be >= 1", "max_tokens")
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise RequestError("stop must be a string or an array of strings", "stop")
    top_k = _field(body, "top_k", (int,), 0)
    min_tokens = _field(body, "min_tokens", (int,), 0)  # vLLM's: no EOS or stop token id before this many tokens
    if limit is not None and min_tokens > limit:
        raise RequestError(f"min_tokens = {min_tokens}: must be <= max_tokens ({limit})", "min_tokens")
    seed = _field(body, "seed", (int,), int_range=(SEED_MIN, SEED_MAX))  # signed or unsigned 64-bit
    logprobs, top_logprobs = _parse_logprobs(body, chat=chat)
    stream = _field(body, "stream", (bool,), False)
    stream_options = _field(body, "stream_options", (dict,), {})
    include_usage = stream_options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise RequestError("stream_options.include_usage must be a boolean", "stream_options.include_usage")
    _field(body, "user", (str,))
    sampling = SamplingParams(
        max_tokens=limit or 1,  # replaced by the server once the prompt length is known
        temperature=_number(body, "temperature", 1.0),
        top_k=0 if top_k == -1 else top_k,  # vLLM spells "off" as -1
        top_p=_number(body, "top_p", 1.0),
        min_p=_number(body, "min_p", 0.0),
        seed=seed,
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0),
        logprobs=top_logprobs if logprobs else None,
        stop=[s for s in stop if s],
        ignore_eos=_field(body, "ignore_eos", (bool,), False),  # vLLM's, for benchmarks: run to max_tokens
        min_tokens=min_tokens,
    )
    try:
        sampling.validate()
    except ValueError as err:
        raise RequestError(str(err), str(err).split(" ", 1)[0]) from err
    return GenerationOptions(sampling, limit, stream, include_usage, logprobs, top_logprobs)


def _parse_logprobs(body: dict, *, chat: bool) -> tuple[bool, int]:
    if chat:
        logprobs = _field(body, "logprobs", (bool,), False)
        top = _field(body, "top_logprobs", (int,), 0)
        if not 0 <= top <= 20:
            raise RequestError(f"top_logprobs = {top}: must be in [0, 20]", "top_logprobs")
        if top and not logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        return logprobs, top
    top = _field(body, "logprobs", (int,))  # completions: logprobs is the number of alternatives
    if top is None:
        return False, 0
    if not 0 <= top <= 20:
        raise RequestError(f"logprobs = {top}: must be in [0, 20]", "logprobs")
    return True, top


# --- /v1/completions ---


def parse_completion_request(body) -> CompletionRequest:
    body = _require_object(body)
    if _field(body, "suffix", (str,)):
        raise RequestError("suffix (fill-in-the-middle) is not supported by this model", "suffix")
    if "prompt" not in body:
        raise RequestError("prompt is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    if not (isinstance(prompt, str) or is_ids):
        raise RequestError("prompt must be a string or an array of token ids (one prompt per request)", "prompt")
    if not prompt:
        raise RequestError("prompt is empty", "prompt")
    return CompletionRequest(prompt, parse_options(body, chat=False), echo=_field(body, "echo", (bool,), False))


# --- /v1/chat/completions ---


def parse_chat_request(body, *, default_system_prompt: str | None) -> ChatRequest:
    body = _require_object(body)
    messages = normalize_messages(_field(body, "messages", (list,), None))
    if default_system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": default_system_prompt})
    tools = _parse_tools(_field(body, "tools", (list,), None))
    tool_params = {t["function"]["name"]: f"tools[{i}].function.parameters"
                   for i, t in reversed(list(enumerate(tools or [])))}  # a name used twice: its first
    tool_choice = _parse_tool_choice(body.get("tool_choice"), tools)
    if tool_choice == "none":
        tools = None
    elif isinstance(tool_choice, dict):
        tools = [t for t in tools if t["function"]["name"] == tool_choice["function"]["name"]]
    request = ChatRequest(messages, parse_options(body, chat=True), tools, tool_choice, tool_params=tool_params)
    request.parallel_tool_calls = _field(body, "parallel_tool_calls", (bool,), True)
    request.template_kwargs = _template_kwargs(body)
    response_format = request.template_kwargs.get("response_format")
    if response_format is not None:  # the answer is held to it (structured_output.py): any object, or the schema
        request.response_schema = response_format.get("schema") or {"type": "object"}
    return request


def _template_kwargs(body: dict) -> dict:
    kwargs = dict(_field(body, "chat_template_kwargs", (dict,), {}))
    reserved = sorted(RESERVED_TEMPLATE_ARGS.intersection(kwargs))
    if reserved:
        raise RequestError(f"chat_template_kwargs.{reserved[0]}: set by the server from the request itself, "
                           f"not a template option (reserved: {', '.join(sorted(RESERVED_TEMPLATE_ARGS))})",
                           f"chat_template_kwargs.{reserved[0]}")
    if "enable_thinking" in kwargs and "reasoning" not in kwargs:
        kwargs["reasoning"] = kwargs.pop("enable_thinking")  # Qwen's spelling; cmd4 reads `reasoning`
    for name in ("reasoning", "regen_tool_call_ids"):
        if name in kwargs and not isinstance(kwargs[name], bool):
            raise RequestError(f"chat_template_kwargs.{name} must be a boolean", f"chat_template_kwargs.{name}")
    effort = _field(body, "reasoning_effort", (str,))
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
        kwargs.setdefault("reasoning", effort.lower() != "none")
    response_format = _response_format(_field(body, "response_format", (dict,)))
    if response_format is not None:
        kwargs["response_format"] = response_format
    return kwargs


def _response_format(response_format: dict | None) -> dict | None:
    """What the template reads: {"type": "json_object"}, with the schema when there is one; None for text."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise RequestError(f"response_format.type = {_short(kind)}: must be text, json_object or json_schema",
                           "response_format.type")
    if kind == "text":
        return None
    schema, param = response_format.get("schema"), "response_format.schema"
    if kind == "json_schema":
        json_schema = response_format.get("json_schema")
        if not isinstance(json_schema, dict):
            raise RequestError('response_format.json_schema must be an object: {"name": ..., "schema": {...}}',
                               "response_format.json_schema")
        schema, param = json_schema.get("schema"), "response_format.json_schema.schema"
        if json_schema.get("strict") is not None and not isinstance(json_schema["strict"], bool):  # both are enforced
            raise RequestError("response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict")
    if schema is not None and not isinstance(schema, dict):
        raise RequestError(f"{param} must be a JSON schema (an object), got {type(schema).__name__}", param)
    return {"type": "json_object", "schema": schema} if schema else {"type": "json_object"}


def _parse_tools(tools: list | None) -> list[dict] | None:
    if not tools:
        return None
    parsed = []
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
            raise RequestError(f"{param} must be {{\"type\": \"function\", \"function\": {{...}}}}", param)
        fn = tool["function"]
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"{param}.function.name must be a non-empty string", f"{param}.function.name")
        if not isinstance(fn.get("description", ""), (str, type(None))):
            raise RequestError(f"{param}.function.description must be a string", f"{param}.function.description")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise RequestError(f"{param}.function.parameters must be a JSON schema object", f"{param}.function.parameters")
        parsed.append({"type": "function", "function": {"name": fn["name"], "description": fn.get("description") or "", "parameters": params}})
    return parsed


def _parse_tool_choice(choice, tools: list[dict] | None) -> str | dict:
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise RequestError(f"tool_choice = {choice!r}: must be none, auto, required or a named function", "tool_choice")
        if choice == "required" and not tools:
            raise RequestError("tool_choice is required but no tools were given", "tool_choice")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise RequestError('tool_choice must be a string or {"type": "function", "function": {"name": ...}}', "tool_choice")
    if not any(t["function"]["name"] == name for t in tools or []):
        raise RequestError(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    return {"type": "function", "function": {"name": name}}
