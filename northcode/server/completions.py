"""POST /v1/completions: a raw prompt (text or token ids) continued as plain text, streaming or not.

No chat template and no output parsing: the text is the engine's own text_delta (special tokens
skipped, stop strings cut by the engine). BOS is added to a text prompt that does not start with
it, as transformers' tokenizer does for this model.
"""

from __future__ import annotations

import time

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from northcode.server.chat_template import encode_text
from northcode.server.errors import RequestError
from northcode.server.generation import EngineRun, engine_error, prepare_sampling
from northcode.server.request_body import read_json
from northcode.server.responses import completion_logprobs, sse, usage_chunk, usage_dict
from northcode.server.schemas import CompletionRequest, parse_completion_request

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def prompt_ids_of(tokenizer, prompt: str | list[int], *, with_bos: bool = True) -> list[int]:
    if isinstance(prompt, list):
        vocab = tokenizer.vocab_size
        bad = next((t for t in prompt if t >= vocab), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad} is outside the vocabulary (size {vocab})", "prompt")
        return list(prompt)
    ids = encode_text(tokenizer, prompt, allow_special=True)
    if with_bos and tokenizer.bos_id is not None and (not ids or ids[0] != tokenizer.bos_id):
        ids = [tokenizer.bos_id, *ids]
    return ids


async def completions(request: Request):
    state = request.app.state.server
    state.require_ready()
    req, prompt_ids = await run_in_threadpool(_parse, state, await read_json(request))
    tokenizer = state.engine.tokenizer
    sampling = prepare_sampling(state, req.options, len(prompt_ids), [], prompt_param="prompt")
    run = EngineRun(state, request, "cmpl", prompt_ids, sampling, prompt_param="prompt")
    await run.start()
    echo = (req.prompt if isinstance(req.prompt, str) else tokenizer.decode(req.prompt)) if req.echo else ""
    if req.options.stream:
        return StreamingResponse(_stream(state, run, req, echo), media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse(await _complete(state, run, req, echo))


def _parse(state, body) -> tuple[CompletionRequest, list[int]]:
    """The validated request and its prompt ids (a worker thread: both grow with the prompt)."""
    req = parse_completion_request(body)
    return req, prompt_ids_of(state.engine.tokenizer, req.prompt)


def _finish_reason(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


async def _complete(state, run: EngineRun, req: CompletionRequest, echo: str) -> dict:
    text, entries, final = echo, [], None
    async for out in run.outputs():
        text += out.text_delta
        entries += out.logprobs or []
        final = out
    if final.finish_reason == "error":
        raise engine_error(state, final)
    state.metrics.record_finished(final)
    logprobs = completion_logprobs(state.engine.tokenizer, entries, len(echo)) if req.options.logprobs else None
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": _finish_reason(final.finish_reason)}
    return {"id": run.request_id, "object": "text_completion", "created": int(time.time()), "model": state.options.model_name,
            "choices": [choice], "usage": usage_dict(final.usage)}


async def _stream(state, run: EngineRun, req: CompletionRequest, echo: str):
    created, model, rid = int(time.time()), state.options.model_name, run.request_id
    offset, final = len(echo), None

    def chunk(text: str, finish_reason: str | None = None, logprobs: dict | None = None) -> bytes:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse({"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]})

    if echo:
        yield chunk(echo)
    async for out in run.outputs():
        final = out
        logprobs = completion_logprobs(state.engine.tokenizer, out.logprobs or [], offset) if req.options.logprobs else None
        if out.text_delta or (logprobs and logprobs["tokens"]):
            yield chunk(out.text_delta, logprobs=logprobs)
        offset += len(out.text_delta)
    if final.finish_reason == "error":
        yield sse(engine_error(state, final).body())
        yield sse("[DONE]")
        return
    state.metrics.record_finished(final)
    yield chunk("", finish_reason=_finish_reason(final.finish_reason))
    if req.options.include_usage:
        yield sse(usage_chunk(rid, created, model, "text_completion", usage_dict(final.usage)))
    yield sse("[DONE]")
