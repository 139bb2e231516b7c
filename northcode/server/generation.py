"""EngineRun: one request's trip through the engine, with admission, disconnect watching and abort.

Whatever ends the response (a finished request, a client that hung up, an exception, a stream
cancelled by starlette), `close()` leaves nothing behind: an unfinished engine request is aborted
(the engine frees its KV pages) and the admission slot is released. The first output is awaited
before any response is sent, so a request the engine refuses (ValueError) is still a clean 400, and
one it ends at once with an error (a failed engine) a clean 503 or 500.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request

from northcode.engine.grammar import GrammarError
from northcode.engine.request import RequestOutput, SamplingParams
from northcode.server.errors import RequestError
from northcode.server.schemas import GenerationOptions


def prepare_sampling(state, options: GenerationOptions, prompt_len: int, extra_stop_ids: list[int],
                     prompt_param: str = "messages") -> SamplingParams:
    """Check the prompt against the context and fill in max_tokens (default: the rest of the context)."""
    max_len = state.engine.max_model_len
    if prompt_len >= max_len:
        raise context_length_exceeded(max_len, prompt_len, prompt_param)
    room = max_len - prompt_len
    sampling = options.sampling
    sampling.max_tokens = min(options.max_tokens, room) if options.max_tokens is not None else room
    sampling.stop_token_ids = sorted(set(sampling.stop_token_ids) | set(extra_stop_ids))
    return sampling


def context_length_exceeded(max_len: int, prompt_len: int, prompt_param: str = "messages") -> RequestError:
    return RequestError(
        f"This model's maximum context length is {max_len} tokens, but the prompt has {prompt_len} tokens "
        "(leaving no room for a completion). Shorten the messages or compact the conversation.",
        prompt_param, code="context_length_exceeded",
    )


def engine_error(state, final: RequestOutput) -> RequestError:
    """A request the engine ended with an error: a 503 once the engine has failed for good (the fatal
    listener ran before the engine ended its requests), else a 500 with the engine's message."""
    if state.engine_error is not None:
        return state.engine_failure()
    return RequestError(f"the engine failed: {final.error}", status=500, error_type="server_error")


class EngineRun:
    def __init__(self, state, request: Request, prefix: str, prompt_ids: list[int], sampling: SamplingParams,
                 prompt_param: str = "messages") -> None:
        self.state = state
        self._prompt_param = prompt_param  # named in the 400 when the engine refuses the prompt
        self.request_id = f"{prefix}-{uuid.uuid4().hex}"
        self._request = request
        self._prompt_ids = prompt_ids
        self._sampling = sampling
        self._outputs: AsyncIterator[RequestOutput] | None = None
        self._first: RequestOutput | None = None
        self._finished = False
        self._closed = False
        self._watcher: asyncio.Task | None = None

    async def start(self) -> None:
        """Admit the request and wait for its first output; RequestError if it cannot run."""
        self.state.admit()
        self._watcher = asyncio.create_task(self._watch_disconnect())
        try:
            self._outputs = self.state.engine.generate(self.request_id, self._prompt_ids, self._sampling)
            self._first = await self._outputs.__anext__()
        except GrammarError as err:  # the tokenizer-free check passed (structured_output.py), the build did not
            await self.close()
            raise RequestError(str(err), "response_format") from err
        except ValueError as err:  # the engine refuses it before the first output: prompt or pool too small
            await self.close()
            raise RequestError(str(err), self._prompt_param, code="context_length_exceeded") from err
        except BaseException:
            await self.close()
            raise
        self._finished = self._first.finished
        if self._first.finished and self._first.finish_reason == "error":  # before any response is sent: a
            await self.close()  # clean error status, not a 200 stream holding an error event
            raise engine_error(self.state, self._first)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        assert self._first is not None, "start() first"
        try:
            yield self._first
            if not self._first.finished:
                async for out in self._outputs:
                    self._finished = out.finished
                    yield out
        finally:
            await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._watcher is not None:
            self._watcher.cancel()
        if not self._finished:
            self.state.engine.abort(self.request_id)
        self.state.release()  # before any await: in a cancelled stream every await raises at once
        if self._outputs is not None:
            try:
                await self._outputs.aclose()
            except (RuntimeError, StopAsyncIteration):  # already closed or running elsewhere
                pass

    async def _watch_disconnect(self) -> None:
        while True:
            message = await self._request.receive()
            if message["type"] == "http.disconnect":
                if not self._finished:
                    self.state.engine.abort(self.request_id)
                return
