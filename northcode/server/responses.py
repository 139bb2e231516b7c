"""OpenAI response shapes: chunks, messages, usage, logprobs and SSE framing. Pure functions of their inputs.

Everything the server writes is strict JSON: SSE events are dumped with allow_nan=False, as starlette's
JSONResponse does, and a logprob that is not a finite number (-inf for a token the distribution rules
out) is written as LOGPROB_FLOOR, the way vLLM writes it, so no NaN or Infinity ever reaches a client.
"""

from __future__ import annotations

import json
import math

from northcode.engine.request import TokenLogprob, Usage

LOGPROB_FLOOR = -9999.0  # natural log; vLLM's stand-in for -inf
# Line breaks to str.splitlines (httpx's aiter_lines among the readers that split that way) that JSON leaves raw:
# escaped, an event is one line to every reader. SSE itself ends a line only at CR or LF.
_SPLITLINES_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: dict | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line (ValueError for a NaN or infinite float)."""
    if isinstance(payload, str):
        return f"data: {payload}\n\n".encode()
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return f"data: {data.translate(_SPLITLINES_BREAKS)}\n\n".encode()


def finite_logprob(logprob: float) -> float:
    """-inf (and NaN, from a broken distribution) as LOGPROB_FLOOR; everything JSON can hold as it is."""
    return logprob if math.isfinite(logprob) and logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def usage_dict(usage: Usage, reasoning_tokens: int | None = None) -> dict:
    out = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def chat_chunk(request_id: str, created: int, model: str, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def usage_chunk(request_id: str, created: int, model: str, object_name: str, usage: dict) -> dict:
    return {"id": request_id, "object": object_name, "created": created, "model": model, "choices": [], "usage": usage}


def chat_message(content: str, reasoning: str, tool_calls: list[dict], *, reasoning_alias: bool) -> dict:
    message = {"role": "assistant", "content": content if (content or not tool_calls) else None}
    if reasoning:
        message["reasoning_content"] = reasoning
        if reasoning_alias:
            message["reasoning"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def chat_logprobs(tokenizer, entries: list[TokenLogprob], hidden_ids: frozenset[int]) -> list[dict]:
    """OpenAI chat logprobs content entries; marker tokens (hidden_ids) are left out like their text."""
    out = []
    for entry in entries:
        if entry.token_id in hidden_ids:
            continue
        token = tokenizer.decode([entry.token_id], skip_special_tokens=False)
        top = [_top_entry(tokenizer, tid, lp) for tid, lp in entry.top]
        out.append({"token": token, "logprob": finite_logprob(entry.logprob), "bytes": list(token.encode()), "top_logprobs": top})
    return out


def _top_entry(tokenizer, token_id: int, logprob: float) -> dict:
    token = tokenizer.decode([token_id], skip_special_tokens=False)
    return {"token": token, "logprob": finite_logprob(logprob), "bytes": list(token.encode())}


def completion_logprobs(tokenizer, entries: list[TokenLogprob], text_offset: int) -> dict:
    """Legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for entry in entries:
        token = tokenizer.decode([entry.token_id], skip_special_tokens=False)
        tokens.append(token)
        token_logprobs.append(finite_logprob(entry.logprob))
        tops.append({tokenizer.decode([tid], skip_special_tokens=False): finite_logprob(lp) for tid, lp in entry.top})
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
