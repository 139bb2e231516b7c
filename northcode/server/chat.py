"""POST /v1/chat/completions: messages -> prompt ids -> engine -> parsed reasoning, content and tool calls.

response_format and tool_choice become the grammar the engine holds the turn to (structured_output.py).
The same OutputParser runs for streaming and non-streaming requests; streaming sends its deltas
as chunks the moment they exist (first a role chunk, then deltas, a finish chunk, the usage
chunk with "choices": [] when asked for, and [DONE]). An engine error after the stream started
is sent as a `{"error": ...}` event before [DONE].
"""

from __future__ import annotations

import time
from functools import partial

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from northcode.server.chat_template import PromptTooLong
from northcode.server.errors import RequestError
from northcode.server.generation import EngineRun, context_length_exceeded, engine_error, prepare_sampling
from northcode.server.output_parser import OutputParser
from northcode.server.request_body import read_json
from northcode.server.responses import chat_chunk, chat_logprobs, chat_message, sse, usage_chunk, usage_dict
from northcode.server.schemas import ChatRequest, parse_chat_request
from northcode.server.structured_output import chat_grammar

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def chat_completions(request: Request):
    state = request.app.state.server
    state.require_ready()
    chat, prompt_ids = await run_in_threadpool(partial(build_prompt, fits_context=True), state, await read_json(request))
    run, parser = await start_chat_run(state, request, chat, prompt_ids, "chatcmpl")
    if chat.options.stream:
        return StreamingResponse(_stream(state, run, chat, parser), media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse(await _complete(state, run, chat, parser))


async def start_chat_run(state, request: Request, chat: ChatRequest, prompt_ids: list[int],
                         prefix: str) -> tuple[EngineRun, OutputParser]:
    """The engine path every chat-shaped front end shares: the turn's grammar (response_format, tool_choice),
    sampling, the output parser and the admitted EngineRun, its first output awaited (RequestError if it
    cannot run)."""
    engine, markers = state.engine, state.markers
    grammar = await run_in_threadpool(chat_grammar, chat, prompt_ids, markers)  # checks schemas: off the loop
    sampling = prepare_sampling(state, chat.options, len(prompt_ids), [markers.start_of_turn, markers.end_of_turn])
    sampling.grammar = grammar
    parser = OutputParser(
        engine.tokenizer, markers,
        start_in_reasoning=bool(prompt_ids) and prompt_ids[-1] == markers.start_thinking,
        stop=sampling.stop, tools_enabled=chat.tools is not None,
        parallel_tool_calls=chat.parallel_tool_calls, reasoning_alias=state.options.reasoning_alias,
    )
    run = EngineRun(state, request, prefix, prompt_ids, sampling)
    await run.start()
    return run, parser


def build_prompt(state, body, *, fits_context: bool = False) -> tuple[ChatRequest, list[int]]:
    """Validate a chat request and render its prompt ids (the default system prompt added when none).
    With fits_context, a prompt that leaves no room in the context is a 400, found before its ids are
    built. Its time grows with the history: call it in a worker thread."""
    chat = parse_chat_request(body, default_system_prompt=state.options.default_system_prompt)
    max_len = state.engine.max_model_len
    try:
        ids = state.template.encode(state.engine.tokenizer, chat.messages, chat.tools, add_generation_prompt=True,
                                    token_limit=max_len - 1 if fits_context else None, **chat.template_kwargs)
    except PromptTooLong as err:
        raise context_length_exceeded(max_len, err.num_tokens) from None
    except ValueError as err:
        raise RequestError(str(err), "messages") from err
    return chat, ids


def _finish_reason(engine_reason: str | None, parser: OutputParser) -> str:
    if engine_reason == "length":
        return "length"
    return "tool_calls" if parser.tool_calls else "stop"


async def _complete(state, run: EngineRun, chat: ChatRequest, parser: OutputParser) -> dict:
    logprobs, final = [], None
    async for out in run.outputs():
        parser.feed(out.token_ids)
        if chat.options.logprobs and out.logprobs:
            logprobs += chat_logprobs(state.engine.tokenizer, out.logprobs, state.markers.special_ids)
        final = out
    parser.finish()
    if final is not None and final.finish_reason == "error":
        raise engine_error(state, final)
    state.metrics.record_finished(final)
    message = chat_message(parser.content, parser.reasoning, parser.tool_calls, reasoning_alias=state.options.reasoning_alias)
    choice = {"index": 0, "message": message, "logprobs": {"content": logprobs} if chat.options.logprobs else None,
              "finish_reason": _finish_reason(final.finish_reason, parser)}
    return {"id": run.request_id, "object": "chat.completion", "created": int(time.time()), "model": state.options.model_name,
            "choices": [choice], "usage": usage_dict(final.usage, parser.reasoning_tokens)}


async def _stream(state, run: EngineRun, chat: ChatRequest, parser: OutputParser):
    created, model, rid = int(time.time()), state.options.model_name, run.request_id
    tokenizer, hidden = state.engine.tokenizer, state.markers.special_ids
    yield sse(chat_chunk(rid, created, model, {"role": "assistant", "content": ""}))
    final = None
    async for out in run.outputs():
        final = out
        deltas = parser.feed(out.token_ids)
        logprobs = chat_logprobs(tokenizer, out.logprobs, hidden) if chat.options.logprobs and out.logprobs else None
        if logprobs and not deltas:
            deltas = [{}]
        for i, delta in enumerate(deltas):
            yield sse(chat_chunk(rid, created, model, delta, logprobs={"content": logprobs} if (logprobs and i == 0) else None))
    for delta in parser.finish():
        yield sse(chat_chunk(rid, created, model, delta))
    if final is not None and final.finish_reason == "error":
        yield sse(engine_error(state, final).body())
        yield sse("[DONE]")
        return
    state.metrics.record_finished(final)
    yield sse(chat_chunk(rid, created, model, {}, finish_reason=_finish_reason(final.finish_reason, parser)))
    if chat.options.include_usage:
        yield sse(usage_chunk(rid, created, model, "chat.completion.chunk", usage_dict(final.usage, parser.reasoning_tokens)))
    yield sse("[DONE]")
