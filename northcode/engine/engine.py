"""Engine: owns the KV cache, scheduler, backend and sampler; runs the step loop in its own thread.

The server's API (docs/architecture.md): `async generate(request_id, prompt_ids, params)` yields
RequestOutputs (the last has finished=True, usage and timings), `abort(request_id)` from any thread,
`stats()`, `shutdown()`, `add_fatal_listener(callback)`. Threads: the event loop only validates and
enqueues; the step thread owns every mutable part (scheduler, pages, sequences) and hands outputs back
through `loop.call_soon_threadsafe` into one asyncio.Queue per request, so the event loop never blocks.
A step: schedule -> prefill chunks -> one decode step for all decoding rows -> sample -> detokenise,
check stops -> emit. It knows nothing of HTTP or chat templates, and imports no backend: it builds one
with the `backend_factory` it is given (northcode/runtime.py chooses torch or the megakernel, and says why).

Threads: torch's CPU pool is sized once, at start (settings.cpu_threads: not one per core by default).
Hangs and failures: the model part of each step runs through its StepGuard (recovery.py, the watchdog); a
step that overruns or raises ends its requests with an error (only the request whose sampling cannot be
built, when one is to blame) and the backend is rebuilt, or, when the device is lost, `fatal_error` is set
and reported. Pipelining (pipeline.py): while every request is device-sampled, the step launches decode n+1
before it reads step n's tokens, so the GPU does not wait while this thread detokenises, checks stops and
schedules; otherwise the backend samples on the device the rows that are device-sampled and the Sampler the
rest (penalties, logprobs), so a seed's tokens do not depend on what else is in the batch. A request with a
grammar (SamplingParams.grammar, compiled by grammar.py off the event loop) has each token masked: the mask
of a decode step is computed while the device runs its model step; a complete grammar ends it ("stop").
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import AsyncIterator, Callable

import torch

from northcode.config import ModelConfig
from northcode.engine.backend import BackendChoice, BackendFactory, DecodeBatch, ModelBackend, PrefillBatch, PrefillChunk
from northcode.engine.grammar import CompiledGrammar, GrammarCompiler, RequestGrammar, constrained_masks
from northcode.engine.kv_cache import KVCacheManager, context_limit, kv_page_budget
from northcode.engine.pipeline import DecodePipeline, can_pipeline, read_tokens
from northcode.engine.recovery import RESTART, StepGuard, attempt, fault_of, step_shapes
from northcode.engine.request import FinishReason, RequestOutput, SamplingParams, TokenLogprob
from northcode.engine.sampling import BatchSamplingArgs, Sampler, StopStringFilter, TokenMasks, apply_token_masks
from northcode.engine.scheduler import Scheduler, StepPlan
from northcode.engine.sequence import RequestState, Sequence, sampling_rows
from northcode.engine.settings import EngineSettings, cpu_threads
from northcode.model.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05  # the step thread sleeps at most this long when there is nothing to run
CALLER_REASON = "given by the caller (backend_factory)"  # backend_reason of a factory that gives none

Sampled = list[tuple[Sequence, int, TokenLogprob | None]]  # a step's tokens: (sequence, token, its logprob)


def _rows_of(logits: torch.Tensor, index: list[int]) -> torch.Tensor:
    """logits [B, V] -> [len(index), V]: the rows picked (the tensor itself when that is every row in order)."""
    return logits if index == list(range(logits.shape[0])) else logits[index]


class Engine:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: Tokenizer | None,
                 settings: EngineSettings | None = None, model_name: str = "model", *,
                 backend_factory: BackendFactory, max_pages: int | None = None) -> None:
        """backend_factory builds the backend, now and after a failed step (runtime.py's BackendBuilder, or a
        test's); max_pages: the most KV pages that backend can run over (None: no limit)."""
        self.settings = settings = settings or EngineSettings()
        torch.set_num_threads(cpu_threads(settings.num_threads))  # process-wide; before any step runs
        log.info("engine: %d CPU threads for torch", torch.get_num_threads())
        self.config, self.tokenizer, self.model_name = config, tokenizer, model_name
        self._weights = weights  # kept on the device: a restarted backend is built from them again
        embed = weights["model.embed_tokens.weight"]
        self.num_pages = num_pages = kv_page_budget(config, settings, embed.dtype, embed.device, max_pages)
        self.max_model_len = context_limit(config, settings, KVCacheManager(config, num_pages, settings.page_size, 1, 1))
        if self.max_model_len < 2:
            raise ValueError(f"the KV pool of {num_pages} pages cannot hold even a 2-token sequence")
        self.max_pages_per_seq = -(-self.max_model_len // settings.page_size)
        self.kv, self.scheduler = self._fresh_cache()
        self._backend_factory = backend_factory
        self.backend_choice = BackendChoice("?", CALLER_REASON)
        self.backend: ModelBackend | None = self._build_backend()
        log.info("engine backend: %s (%s)", self.backend_choice.name, self.backend_choice.reason)
        self.sampler, self.pipeline = Sampler(), DecodePipeline()
        self.grammars = GrammarCompiler.for_tokenizer(tokenizer, config.vocab_size) if tokenizer else None
        self.guard = StepGuard(settings, self._on_step_overdue, self._on_step_lost)
        self._seeds = random.Random(settings.seed) if settings.seed is not None else random.SystemRandom()
        self._arrivals = 0
        self._lock = threading.Condition()
        self._inbox: list[RequestState] = []
        self._aborts: list[str] = []
        self._requests: dict[str, RequestState] = {}  # step thread only (the watchdog reads it while a step hangs)
        self._ids: set[str] = set()  # ids submitted and not yet finished (any thread, under the lock)
        self._stats: dict[str, object] = {}
        self._stopping = False
        self._in_step: list[Sequence] = []  # the sequences of the step running now
        self.restarts = 0  # backend restarts after a hung or failed step
        self.fatal_error: str | None = None  # set once the device is lost; every request then fails with it
        self._fatal_listeners: list[Callable[[str], None]] = []
        self._publish_stats()
        self._thread = threading.Thread(target=self._loop, name="northcode-engine", daemon=True)
        self._thread.start()

    def _fresh_cache(self) -> tuple[KVCacheManager, Scheduler]:
        s = self.settings
        kv = KVCacheManager(self.config, self.num_pages, s.page_size, s.max_batch, self.max_pages_per_seq,
                            s.enable_prefix_cache)
        return kv, Scheduler(kv, s.max_batch, s.chunk_size, self.max_model_len)

    def _build_backend(self) -> ModelBackend:
        """The backend (again, after a restart) from the weights on the device, warmed up (graphs captured)."""
        backend = self._backend_factory(self.config, self._weights, self.settings, self.num_pages,
                                        self.max_pages_per_seq)
        self.backend_choice = BackendChoice(backend.name, getattr(self._backend_factory, "reason", CALLER_REASON))
        backend.warm_up()
        return backend

    # --- the API (any thread) ---

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they come; ValueError before the first for a bad request.
        Closing the iterator early (client gone) aborts the request."""
        params = params or SamplingParams()
        loop = asyncio.get_running_loop()
        grammar = None if params.grammar is None else await loop.run_in_executor(None, self.compile_grammar, params)
        request = self._make_request(request_id, list(prompt_token_ids), params, loop, grammar)
        finished = False
        try:
            while not finished:
                output = await request.queue.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    def compile_grammar(self, params: SamplingParams) -> CompiledGrammar:
        """The request's grammar built against the tokenizer, from the cache when it was before (any thread; it
        may take a while the first time); ValueError (grammar.GrammarError) naming what cannot be compiled."""
        params.validate()
        if self.grammars is None:
            raise ValueError("grammar: constrained decoding needs a tokenizer, and this engine has none")
        return self.grammars.compile(params.grammar.grammar)

    def _make_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      loop: asyncio.AbstractEventLoop, grammar: CompiledGrammar | None = None) -> RequestState:
        params.validate()
        params = params.clamped_to(self.config.vocab_size)  # what the samplers and the kernel's row can hold
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer, and this engine has none")
        bad = next((t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < self.config.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: {bad!r} is not a token id (vocabulary of {self.config.vocab_size})")
        max_new = min(params.max_tokens, self.max_model_len - len(prompt_ids))
        self.scheduler.check_fits(len(prompt_ids), max(1, max_new))
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        with self._lock:
            if self.fatal_error is not None:  # the device is lost: the request ends at once with the reason
                request = RequestState(Sequence(request_id, prompt_ids, params, seed, max_new, 0), asyncio.Queue(),
                                       loop, None, StopStringFilter([]), ended=True)
                request.queue.put_nowait(request.final_output("error", self.fatal_error))
                return request
            if request_id in self._ids:
                raise ValueError(f"request_id {request_id!r} is already running")
            self._arrivals += 1
            sequence = Sequence(request_id, prompt_ids, params, seed, max_new, self._arrivals)
            detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens) if self.tokenizer else None
            request = RequestState(sequence, asyncio.Queue(), loop, detokenizer, StopStringFilter(params.stop),
                                   grammar=RequestGrammar(grammar, params.grammar) if grammar is not None else None)
            self._ids.add(request_id)
            self._inbox.append(request)
            self._lock.notify()
        return request

    def abort(self, request_id: str) -> None:
        """Stop a request and free its pages (thread-safe; unknown or finished ids are ignored)."""
        with self._lock:
            if request_id in self._ids:
                self._aborts.append(request_id)
                self._lock.notify()

    def stats(self) -> dict[str, object]:
        """Numbers (pages, prefix cache, requests, restarts), and `backend`, `backend_reason` (which backend
        runs and why), `status` (ok, restarting, failed) and `fatal_error` (None, or why nothing can run)."""
        with self._lock:
            return dict(self._stats)

    def add_fatal_listener(self, callback: Callable[[str], None]) -> None:
        """Call callback(message) once if the device is lost (from the watchdog's thread; at once if it is
        already). The server uses it to report on /health and exit non-zero for its supervisor."""
        with self._lock:
            message = self.fatal_error
            if message is None:
                self._fatal_listeners.append(callback)
        if message is not None:
            callback(message)

    def shutdown(self) -> None:
        """Stop the step thread and the watchdog. Nothing then refers to the engine but its callers: it is
        freed, its backend's pools with it, as soon as they let go (no reference cycle waits for the collector)."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self.fatal_error is None:  # a thread blocked on a lost device never comes back: do not wait for it
            self._thread.join(timeout=30)
        self.guard.close()

    # --- the step thread ---

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._stopping or self._inbox or self._aborts or self.scheduler.has_work
                           or self.pipeline.launched is not None):
                    self._lock.wait(IDLE_WAIT_S)
                if self._stopping or self.fatal_error is not None:
                    break
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
            for request in inbox:
                self._requests[request.sequence.request_id] = request
                self.scheduler.add(request.sequence)  # checked by _make_request: cannot fail
            for request_id in aborts:
                if request_id in self._requests:
                    self._finish(self._requests[request_id], "abort", None)
            failure = attempt(self._step)  # outside any except block: the failed step's frames are gone
            if failure is not None:
                if self.fatal_error is not None:
                    return  # the device was declared lost while this thread was blocked: touch nothing
                self._after_failed_step(failure)
            self._publish_stats()
        if self.fatal_error is None:
            for request in list(self._requests.values()):
                self._finish(request, "abort", None)

    def _pipelined(self) -> bool:
        """No request, running or waiting, needs the host's history to sample: the step can be pipelined."""
        return can_pipeline(self.scheduler.running + self.scheduler.waiting)

    def _step(self) -> None:
        started = time.perf_counter()
        pipelined = self._pipelined()
        if self.pipeline.launched is not None and not pipelined:
            self._drain()  # a request that needs the host's history arrived: read the step in flight first
        plan = self.scheduler.schedule()
        if plan.is_empty and self.pipeline.launched is None:  # only waiting requests, none admissible: no spin
            time.sleep(0.001)
            return
        self._in_step = plan.decodes + [c.sequence for c in plan.prefills] + self.pipeline.sequences
        shapes = step_shapes(plan, self.settings.page_size, self.max_pages_per_seq)
        if pipelined:  # the prefills' tokens, and those of the decode launched last step
            sampled, launched = self.guard.run(lambda: self._pipelined_model_step(plan), shapes, plan)
        else:
            sampled = self.guard.run(lambda: self._prefill(plan) + self._decode(plan), shapes, plan)
        self._in_step = []
        self.scheduler.commit(plan)
        if pipelined:
            self.pipeline.advance(launched)
        now = time.perf_counter()
        self.scheduler.record(plan, now - started)
        for seq, token, logprob in sampled:
            self._append(self._requests[seq.request_id], token, logprob, now)

    def _pipelined_model_step(self, plan: StepPlan):
        """Prefill chunks, launch decode n+1, read decode n: (the tokens to append, the new launch)."""
        sampled = self._prefill(plan)
        masks_of = self._constrained if self._any_grammar(plan.decodes) else None
        read, launched = self.pipeline.launch_and_read(plan, self.backend, self.kv, masks_of,
                                                       self._text_mask(plan.decodes))
        return sampled + [(seq, token, None) for seq, token in read], launched

    def _drain(self) -> None:
        """Read the step in flight and append its tokens; the engine then runs unpipelined."""
        step = self.pipeline.launched
        self._in_step = list(step.sequences)
        read = self.guard.run(lambda: read_tokens(step), set(), None)
        self.pipeline.launched, self._in_step = None, []
        now = time.perf_counter()
        for seq, token in read:
            self._append(self._requests[seq.request_id], token, None, now)

    def _prefill(self, plan: StepPlan) -> Sampled:
        """Run the plan's prefill chunks; sample after those that end a prompt (in PyTorch)."""
        if not plan.prefills:
            return []
        kv = self.kv
        chunks = [PrefillChunk(c.sequence.row, c.sequence.tokens[c.start:c.end], c.start) for c in plan.prefills]
        logits = self.backend.prefill(PrefillBatch(chunks, kv.block_tables, kv.version, kv.high_water))
        keep = [i for i, c in enumerate(plan.prefills) if c.samples]
        if not keep:
            return []
        sequences = [plan.prefills[i].sequence for i in keep]
        logits = apply_token_masks(logits[keep], self._constrained(sequences) if self._any_grammar(sequences) else None)
        result = self.sampler.sample(logits, sampling_rows(sequences, self.config.eos_token_ids))
        return list(zip(sequences, result.token_ids, result.logprobs))

    def _decode(self, plan: StepPlan) -> Sampled:
        """One decode step for every decoding row. The backend draws every device-sampled row (so a seeded
        request draws the same tokens whatever shares its step: issue 3); the Sampler samples the others
        (penalties, logprobs) from the logits, which come back only when such a row is in the step."""
        sequences = plan.decodes
        if not sequences:
            return []
        kv = self.kv
        host = [b for b, s in enumerate(sequences) if not s.params.is_device_sampled]
        sampling = BatchSamplingArgs.prepare([s.params for s in sequences], [s.seed for s in sequences],
                                             [s.draw for s in sequences])
        batch = DecodeBatch([s.row for s in sequences], [s.last_token for s in sequences],
                            [s.num_computed for s in sequences], sampling, sample=len(host) < len(sequences),
                            return_logits=bool(host), block_tables=kv.block_tables, tables_version=kv.version,
                            tables_columns=kv.high_water)
        if self._any_grammar(sequences):  # computed by the backend while the model step runs
            batch.token_masks, batch.text_mask = lambda: self._constrained(sequences), self._text_mask(sequences)
        result = self.backend.decode(batch)
        assert not batch.sample or result.token_ids is not None, f"{self.backend.name} backend returned no tokens"
        tokens = list(result.token_ids) if batch.sample else [-1] * len(sequences)
        logprobs: list[TokenLogprob | None] = [None] * len(sequences)
        if host:
            sample = self.sampler.sample(_rows_of(result.logits, host),
                                         sampling_rows([sequences[b] for b in host], self.config.eos_token_ids))
            for b, token, logprob in zip(host, sample.token_ids, sample.logprobs):
                tokens[b], logprobs[b] = token, logprob
        return list(zip(sequences, tokens, logprobs))

    def _any_grammar(self, sequences: list[Sequence]) -> bool:
        return any(self._requests[s.request_id].grammar is not None for s in sequences)

    def _text_mask(self, sequences: list[Sequence]) -> torch.Tensor | None:  # DecodeBatch.text_mask, when needed
        bans = any(s.params.grammar is not None and s.params.grammar.ban_while_dormant for s in sequences)
        return self.grammars.text_mask if bans else None

    def _constrained(self, sequences: list[Sequence],
                     read: Callable[[], dict[int, int]] | None = None) -> TokenMasks | None:
        """The token masks of the constrained rows among `sequences`. read (the pipelined step): reads the launch
        in flight, {id(sequence): its token}; called only when an active grammar needs its row's token."""
        grammars = [self._requests[s.request_id].grammar for s in sequences]
        waits = any(g is not None and g.is_active and s.in_flight for g, s in zip(grammars, sequences))
        latest = read() if read is not None and waits else {}
        return constrained_masks(self.grammars, grammars,
                                 [(s.output_ids, latest.get(id(s)), s.in_flight > 0) for s in sequences])

    def _append(self, request: RequestState, token: int, logprob: TokenLogprob | None, now: float) -> None:
        """Record one sampled token; emit its text (held back where a stop string may begin); finish."""
        seq, params = request.sequence, request.sequence.params
        text, matched = request.take_token(token, now)
        reason, stop_reason, error = None, None, None
        if token in params.stop_ids(self.config.eos_token_ids):
            reason, stop_reason = "stop", token
        if matched is not None:
            reason, stop_reason = "stop", matched
        elif reason is None and request.grammar is not None:  # complete ("stop"), or failed ("error")
            reason, error = request.grammar.end(seq.output_ids)
        if reason is None and len(seq.output_ids) >= seq.max_new_tokens:
            reason = "length"
        if reason is None:
            request.emit(RequestOutput(seq.request_id, [token], text, [logprob] if logprob else None))
        else:
            self._finish(request, reason, stop_reason, [token], text, [logprob] if logprob else None, error)

    def _finish(self, request: RequestState, reason: FinishReason, stop_reason: str | int | None,
                token_ids: list[int] | None = None, text: str = "", logprobs: list[TokenLogprob] | None = None,
                error: str | None = None) -> None:
        seq = request.sequence
        if reason in ("length", "stop") and not isinstance(stop_reason, str):  # release held-back text
            tail, matched = request.flush_text()
            text += tail
            if matched is not None:
                reason, stop_reason = "stop", matched
        self.scheduler.finish(seq)
        del self._requests[seq.request_id]
        with self._lock:
            self._ids.discard(seq.request_id)
        self._publish_stats()  # before the final output: a caller that saw it sees the pages freed
        request.emit(request.final_output(reason, error, stop_reason, token_ids, text, logprobs))

    def _publish_stats(self, status: str | None = None) -> None:
        kv, scheduler = self.kv, self.scheduler
        if status is None:
            status = "failed" if self.fatal_error is not None else "ok" if self.backend is not None else "restarting"
        queried = kv.stats.queried_tokens
        stats = {
            "pages_used": kv.num_used_pages, "pages_total": kv.pool.num_pages,
            "prefix_cache_hit_tokens": kv.stats.hit_tokens, "prefix_cache_queried_tokens": queried,
            "prefix_cache_hit_rate": kv.stats.hit_tokens / queried if queried else 0.0,
            "requests_running": len(scheduler.running), "requests_waiting": len(scheduler.waiting),
            "preemptions": scheduler.num_preemptions, "max_batch": self.settings.max_batch, "page_size": self.settings.page_size,
            "backend": self.backend_choice.name, "backend_reason": self.backend_choice.reason, "restarts": self.restarts,
            "status": status, "fatal_error": self.fatal_error,
        }
        with self._lock:
            self._stats = stats

    # --- failed and hung steps (recovery.py has the mechanics) ---

    def _after_failed_step(self, failure: str) -> None:
        """Step thread, after a step failed (failure "": given up by the watchdog): end only the requests
        whose sampling cannot be built when one is to blame, else rebuild the backend."""
        if failure and self._isolate(failure):
            return
        if self.fatal_error is None:
            self._recover(failure or None)

    def _isolate(self, error: str) -> bool:
        """End the requests of the failed step whose own sampling cannot be built (fault_of) and keep the
        backend: read the step in flight (a failed launch may leave nothing to carry from), and the next step
        redoes the others' work (the same positions and tokens: its KV writes are idempotent). False when no
        request is to blame or that read fails; then the backend must be restarted."""
        faults = [(seq, fault) for seq in dict.fromkeys(self._in_step)
                  if (fault := fault_of(seq, self.config.vocab_size)) is not None]
        if not faults:
            return False
        for seq, fault in faults:
            request = self._requests.get(seq.request_id)
            if request is not None and not request.ended:
                log.error("engine: request %s ended: its sampling cannot be built (%s)", seq.request_id, fault)
                self._finish(request, "error", None, error=f"this request's sampling could not be built ({fault}); "
                                                             "it was ended and the other requests went on")
        self._in_step = []
        return self.pipeline.launched is None or attempt(self._drain) is None

    def _recover(self, error: str | None) -> None:
        """After a hung (error None: its requests were already ended) or failed step: end the step's
        requests, then rebuild the KV cache, scheduler and backend from the weights on the device; every
        other request is kept, recomputes what it had, and goes on. A restart that fails is fatal."""
        survivors = self._end_failed_step(error)
        self._publish_stats(status="restarting")
        self.backend = None  # drop the old pools and graphs before allocating new ones
        self.kv, self.scheduler = self._fresh_cache()
        on_device = self._weights["model.embed_tokens.weight"].is_cuda
        backend, why, given_up = self.guard.rebuild(self._build_backend, on_device)
        if given_up:
            return  # the restart overran its limit: _on_step_overdue declared the engine failed
        if backend is None:
            self._declare_fatal(f"the model backend could not be restarted after a failed step ({why}); "
                                "restart the server")
            return
        self.backend = backend
        self.restarts += 1
        for seq in survivors:
            self.scheduler.take_back(seq)
        log.warning("engine: %s backend restarted (restart %d); %d requests kept", self.backend_choice.name,
                    self.restarts, len(survivors))

    def _end_failed_step(self, error: str | None) -> list[Sequence]:
        """End the failed step's requests (and drop those the watchdog ended); the others, in arrival order."""
        for seq in self._in_step:
            request = self._requests.get(seq.request_id)
            if request is not None and not request.ended:
                self._finish(request, "error", None, error=error)
        self._in_step, self.pipeline.launched = [], None  # a launched step's tokens are lost with its backend
        for request_id in [i for i, r in self._requests.items() if r.ended]:
            del self._requests[request_id]
        return sorted((r.sequence for r in self._requests.values()), key=lambda s: s.arrival)

    def _on_step_overdue(self, what: str, limit_s: float) -> None:
        """Watchdog thread, while the step thread is blocked in the step: end the step's requests now."""
        if what == RESTART:
            self._declare_fatal(f"restarting the {self.backend_choice.name} backend did not finish within "
                                f"{limit_s:g} s; restart the server")
            return
        message = (f"the engine's {what} did not finish within {limit_s:g} s (a hung or runaway kernel?); "
                   f"the request was ended and the {self.backend_choice.name} backend is being restarted")
        log.error(message)
        self._publish_stats(status="restarting")  # before the errors: a client that saw one sees the status
        for seq in self._in_step:
            request = self._requests.get(seq.request_id)
            if request is not None and not request.ended:
                self._end_early(request, message)

    def _on_step_lost(self, what: str, waited_s: float) -> None:
        """Watchdog thread: the step never came back. The GPU (or its context) is presumed unusable."""
        self._declare_fatal(f"the device stopped responding: the engine's {what} has not returned after "
                            f"{waited_s:.0f} s, so the GPU or its CUDA context is presumed unusable; "
                            "restart the server")

    def _end_early(self, request: RequestState, message: str) -> None:
        """Send a request's final error output from a thread other than the step thread (which then drops it)."""
        request.ended = True
        with self._lock:
            self._ids.discard(request.sequence.request_id)
        request.emit(request.final_output("error", message))

    def _declare_fatal(self, message: str) -> None:
        """Any thread: nothing can run any more. Every request, present and future, ends with `message`."""
        with self._lock:
            if self.fatal_error is not None:
                return
            self.fatal_error = message
            inbox, self._inbox = self._inbox, []
            listeners, self._fatal_listeners = self._fatal_listeners, []
            self._lock.notify_all()
        log.critical("engine: %s", message)
        self._publish_stats(status="failed")
        for callback in listeners:  # first: the server reports the failure before its clients see it
            try:
                callback(message)
            except Exception:
                log.exception("fatal-error listener failed")
        for request in inbox + [r for r in list(self._requests.values()) if not r.ended]:
            self._end_early(request, message)
