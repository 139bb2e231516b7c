"""What a chat turn may write: response_format and tool_choice as a grammar the engine enforces (engine/grammar.py).

After the generation prompt the model writes cmd4's markup (prompt_format.md, section 3):
  - response_format json_object or json_schema (strict true or false alike): <|START_TEXT|> JSON
    <|END_TEXT|>, the JSON valid against the schema;
  - tool_choice required or a named function: <|START_ACTION|>[ calls ]<|END_ACTION|> as the chat template
    writes calls, each call's parameters valid against its tool's schema, one call unless parallel_tool_calls;
  - auto: free text, or, once the model opens an action block, such calls (a grammar dormant until
    <|START_ACTION|>); with a response_format, the JSON answer or calls; none: the answer alone.
With reasoning on (the prompt ends inside the thinking block) the thinking stays free text and the grammar starts
at <|END_THINKING|>, the only marker a thinking block before a forced answer (a call, a response_format) may
write: it cannot end the turn or open a block first (GrammarSpec.ban_while_dormant); auto's free text may.
JSON is written as the template's tojson writes it (", " and ": ", no other whitespace).
A schema llguidance cannot enforce is a 400 naming the construct, except under auto: a tool's schema is then
enforced leniently (the keywords llguidance lacks are left out), or as any object, and a warning is logged.
"""

from __future__ import annotations

import json
import logging

from northcode.engine.grammar import DUMPS_STYLE, grammar_problem, json_text, schema_problem
from northcode.engine.request import GrammarSpec
from northcode.server.errors import RequestError
from northcode.server.markers import Markers
from northcode.server.schemas import ChatRequest

log = logging.getLogger(__name__)


def chat_grammar(chat: ChatRequest, prompt_ids: list[int], markers: Markers) -> GrammarSpec | None:
    """The grammar of the turn the prompt opens, or None when nothing constrains it; RequestError (400)."""
    forced = chat.tool_choice == "required" or isinstance(chat.tool_choice, dict)
    rules: dict[str, str] = {}
    if chat.response_schema is not None and not forced:
        schema = _enforced(chat.response_schema, "response_format", lenient=False)
        rules["text"] = f"<[{markers.start_text}]> %json {schema} <[{markers.end_text}]>"
    if chat.tools:
        rules.update(_action_rules(chat, markers, lenient=not forced))
    if not rules:
        return None
    if not forced and "text" not in rules:  # auto: free text until the model opens an action block
        return _spec("action", rules, markers.start_action)
    answer = "action" if forced else " | ".join(name for name in ("text", "action") if name in rules)
    if prompt_ids and prompt_ids[-1] == markers.start_thinking:  # the thinking block is free; then the answer
        return _spec(f"<[{markers.end_thinking}]> ({answer})", rules, markers.end_thinking, ban_while_dormant=True)
    return _spec(answer, rules, None)


def json_schema_grammar(schema: dict, param: str) -> GrammarSpec:
    """JSON valid against `schema` and nothing else (no text markers), enforced as a json_schema response_format's
    JSON is; RequestError naming `param` when llguidance cannot enforce it."""
    return _spec(f"%json {_enforced(schema, param, lenient=False)}", {}, None)


def _action_rules(chat: ChatRequest, markers: Markers, lenient: bool) -> dict[str, str]:
    """An action block as the template writes one: `[`, then each call on its own line as
    {"tool_call_id": "N", "tool_name": NAME, "parameters": {...}}, then `]` on its own line."""
    calls = r'call ("," call)*' if chat.parallel_tool_calls else "call"
    rules = {"action": f'<[{markers.start_action}]> "[" {calls} ' + r"/\n\n?\]/" + f" <[{markers.end_action}]>",
             "call": r'/\n\n?    \{"tool_call_id": "[0-9]{1,6}", "tool_name": / tool "}"',
             "tool": " | ".join(f"tool_{i}" for i in range(len(chat.tools)))}
    for i, tool in enumerate(chat.tools):
        function = tool["function"]
        param = chat.tool_params.get(function["name"], "tools")
        schema = _enforced({"type": "object", **function["parameters"]}, param, lenient)  # arguments are an object
        head = json.dumps(json.dumps(function["name"], ensure_ascii=False) + ', "parameters": ')
        rules[f"tool_{i}"] = f"{head} %json {schema}"
    return rules


def _enforced(schema: dict, param: str, lenient: bool) -> str:
    """The schema as the grammar's %json holds it (tojson's style); RequestError when llguidance cannot enforce it,
    unless lenient: then without the keywords it lacks, or at worst any object."""
    text = json_text({**schema, "x-guidance": {**DUMPS_STYLE, "lenient": lenient}})
    problem = schema_problem(text)
    if problem is None:
        return text
    if lenient:
        log.warning("%s cannot be enforced (%s); its arguments are held to any JSON object", param, problem)
        return json_text({"type": "object", "x-guidance": DUMPS_STYLE})
    raise RequestError(f"{param}: this JSON schema cannot be enforced: {problem}", param)


def _spec(start: str, rules: dict[str, str], trigger_id: int | None, ban_while_dormant: bool = False) -> GrammarSpec:
    text = "\n".join(["%llguidance {}", f"start: {start}", *(f"{name}: {body}" for name, body in rules.items())])
    problem = grammar_problem(text)
    if problem is not None:  # every schema passed on its own: the rest is this module's
        raise RequestError(f"the request's response_format and tools cannot be enforced together: {problem}")
    return GrammarSpec(text, trigger_id, ban_while_dormant)
