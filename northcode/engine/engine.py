"""Engine: owns the KV cache, scheduler, backend and sampler; runs the step loop in its own thread.

The server's API (docs/architecture.md): `async generate(request_id, prompt_ids, params)` yields
RequestOutputs (the last has finished=True, usage and timings), `abort(request_id)` from any thread,
`stats()`, `shutdown()`, `add_fatal_listener(callback)`. Threads: the event loop only validates and
enqueues; the step thread owns every mutable part (scheduler, pages, sequences) and hands outputs back
through `loop.call_soon_threadsafe` into one asyncio.Queue per request, so the event loop never blocks.
A step: schedule -> prefill chunks -> one decode step for all decoding rows -> sample -> detokenise,
check stops -> emit. It knows nothing of HTTP or chat templates.

Threads: torch's CPU pool is sized once, at start (settings.cpu_threads: not one per core by default).
Backend: backend_choice.py resolves settings.backend (auto, torch, megakernel) and says why; stats() has
"backend" and "backend_reason". Hangs: the model part of each step (prefill, decode, sampling) runs under
the step watchdog (watchdog.py); a step that overruns or raises ends its requests with an error and the
backend is rebuilt (recovery.py), or, when the device is lost, `fatal_error` is set and reported.

Pipelining (pipeline.py): with a backend that offers launch_decode, the step launches decode n+1 before
it reads step n's tokens (rows feed the token they sampled from device memory), so the GPU does not wait
while this thread detokenises, checks stops and schedules. Both backends offer it: TorchBackend
(torch_backend/launch.py; synchronously on the CPU) and MegakernelBackend (megakernel/backend.py). Unpipelined,
the backend samples every row it can and the Sampler the rest (penalties), so a seed's tokens do not
depend on what else is in the batch.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from northcode.config import ModelConfig
from northcode.engine.backend import DecodeBatch, ModelBackend, PrefillBatch, PrefillChunk
from northcode.engine.backend_choice import BackendChoice, build_backend, choose_backend
from northcode.engine.kv_cache import KVCacheManager, page_bytes
from northcode.engine.pipeline import LaunchedStep, PipelinedSteps
from northcode.engine.recovery import StepAbandoned, StepRecovery, describe_step, step_shapes
from northcode.engine.request import RequestOutput, SamplingParams, Timings, TokenLogprob, Usage
from northcode.engine.sampling import Sampler, SamplingRow, StopStringFilter
from northcode.engine.scheduler import Scheduler, Sequence, StepPlan
from northcode.engine.settings import EngineSettings, cpu_threads
from northcode.engine.watchdog import StepWatchdog
from northcode.model.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05  # the step thread sleeps at most this long when there is nothing to run


@dataclass(eq=False)
class _Request:
    """A request's engine-side state: its sequence, where its outputs go, and its text filters."""

    sequence: Sequence
    queue: asyncio.Queue  # of RequestOutput, read by generate() on `loop`
    loop: asyncio.AbstractEventLoop
    detokenizer: IncrementalDetokenizer | None  # None: an engine without a tokenizer (benchmarks) emits no text
    stops: StopStringFilter
    last_token_at: float | None = None
    latencies: list[float] = field(default_factory=list)
    time_to_first_token: float | None = None
    ended: bool = False  # its final output was sent by the watchdog or a fatal error (the step thread drops it)

    def emit(self, output: RequestOutput) -> None:
        """Hand an output to the request's event loop (called from the step thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, output)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"engine setting device = {name!r}: CUDA is not available on this machine")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


GPU_WORKSPACE_BYTES = 3 << 30  # kept out of the pool: prefill activations and attention scores, graphs


def kv_page_budget(config: ModelConfig, settings: EngineSettings, dtype: torch.dtype, device: torch.device) -> int:
    """Pages of the pool: fixed, or (free GPU memory - workspace) x gpu_memory_fraction, or the CPU byte
    budget. The workspace also covers the torch backend's fused QKV copy of the attention weights."""
    if settings.num_pages is not None:
        return settings.num_pages
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        element_bytes = torch.empty((), dtype=dtype).element_size()
        qkv_bytes = config.num_hidden_layers * (config.q_size + 2 * config.kv_size) * config.hidden_size * element_bytes
        budget = int(max(0, free_bytes - GPU_WORKSPACE_BYTES - qkv_bytes) * settings.gpu_memory_fraction)
    else:
        budget = settings.cpu_kv_bytes
    return max(1, budget // page_bytes(config, settings.page_size, dtype))


def context_limit(config: ModelConfig, settings: EngineSettings, kv: KVCacheManager) -> int:
    """The longest sequence one request may reach: the model's and the user's limits, and the pool."""
    limit = min(config.max_position_embeddings, settings.max_model_len or config.max_position_embeddings)
    low, high = 1, limit  # the largest length whose peak pages fit the whole pool
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if kv.peak_pages(middle, settings.chunk_size) <= kv.pool.num_pages else (low, middle - 1)
    return low


def _rows_of(logits: torch.Tensor, index: list[int]) -> torch.Tensor:
    """logits [B, V] -> [len(index), V]: the rows picked (the tensor itself when that is every row in order)."""
    return logits if index == list(range(logits.shape[0])) else logits[index]


BackendFactory = Callable[[ModelConfig, dict, EngineSettings, int, int], ModelBackend]
# (config, weights, settings, num_pages, max_pages_per_seq) -> a new backend: what the engine builds at start
# and again after a hung or failed step


class Engine(StepRecovery, PipelinedSteps):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: Tokenizer | None,
                 settings: EngineSettings | None = None, model_name: str = "model",
                 backend_factory: BackendFactory | None = None) -> None:
        self.settings = settings = settings or EngineSettings()
        torch.set_num_threads(cpu_threads(settings.num_threads))  # process-wide; before any step runs
        log.info("engine: %d CPU threads for torch", torch.get_num_threads())
        self.config, self.tokenizer, self.model_name = config, tokenizer, model_name
        self._weights = weights  # kept on the device: a restarted backend is built from them again
        device = weights["model.embed_tokens.weight"].device
        dtype = weights["model.embed_tokens.weight"].dtype
        if backend_factory is None:
            self.backend_choice = choose_backend(config, settings, device, dtype)
        else:
            self.backend_choice = BackendChoice("?", "given by the caller (backend_factory)")
        self.num_pages = num_pages = self._page_budget(config, settings, dtype, device)
        probe = KVCacheManager(config, num_pages, settings.page_size, 1, 1)
        self.max_model_len = context_limit(config, settings, probe)
        if self.max_model_len < 2:
            raise ValueError(f"the KV pool of {num_pages} pages cannot hold even a 2-token sequence")
        self.max_pages_per_seq = -(-self.max_model_len // settings.page_size)
        self.kv, self.scheduler = self._fresh_cache()
        self._backend_factory = backend_factory
        self.backend = self._build_backend()
        log.info("engine backend: %s (%s)", self.backend_choice.name, self.backend_choice.reason)
        self.sampler = Sampler()
        self._seeds = random.Random(settings.seed) if settings.seed is not None else random.SystemRandom()
        self._arrivals = 0
        self._lock = threading.Condition()
        self._inbox: list[_Request] = []
        self._aborts: list[str] = []
        self._requests: dict[str, _Request] = {}  # step thread only (the watchdog reads it while a step hangs)
        self._ids: set[str] = set()  # ids submitted and not yet finished (any thread, under the lock)
        self._stats: dict[str, object] = {}
        self._stopping = False
        self._in_step: list[Sequence] = []  # the sequences of the step running now
        self._launched: LaunchedStep | None = None  # the decode step launched and not yet read (pipeline.py)
        self._shapes_seen: set[tuple] = set()  # step shapes run since the backend was built (watchdog limits)
        self.restarts = 0  # backend restarts after a hung or failed step
        self.fatal_error: str | None = None  # set once the device is lost; every request then fails with it
        self._fatal_listeners: list[Callable[[str], None]] = []
        self._watchdog = None
        if settings.step_timeout_s is not None:
            self._watchdog = StepWatchdog(self._on_step_overdue, self._on_step_lost, settings.hang_grace_s)
        self._publish_stats()
        self._thread = threading.Thread(target=self._loop, name="northcode-engine", daemon=True)
        self._thread.start()

    def _page_budget(self, config: ModelConfig, settings: EngineSettings, dtype: torch.dtype,
                     device: torch.device) -> int:
        """kv_page_budget, capped where the torch backend will compile its decode step (compiled_pool_pages)."""
        from northcode.torch_backend.compiled_step import compile_requested, compiled_pool_pages

        pages = kv_page_budget(config, settings, dtype, device)
        if self.backend_choice.name != "torch" or settings.num_pages is not None or \
                not compile_requested(settings.compile, device, settings.cuda_graphs):
            return pages
        cap = compiled_pool_pages(config, settings.page_size)
        if pages > cap:
            log.info("KV pool: %d pages of the %d that fit: the compiled torch step indexes its pool with 32-bit "
                     "offsets (NORTHCODE_TORCH_COMPILE=0 runs the eager step over all of them)", cap, pages)
        return min(pages, cap)

    def _fresh_cache(self) -> tuple[KVCacheManager, Scheduler]:
        s = self.settings
        kv = KVCacheManager(self.config, self.num_pages, s.page_size, s.max_batch, self.max_pages_per_seq,
                            s.enable_prefix_cache)
        return kv, Scheduler(kv, s.max_batch, s.chunk_size, self.max_model_len)

    def _build_backend(self) -> ModelBackend:
        """The backend (again, after a restart) from the weights on the device, warmed up (graphs captured)."""
        args = (self.config, self._weights, self.settings, self.num_pages, self.max_pages_per_seq)
        if self._backend_factory is not None:
            backend = self._backend_factory(*args)
            self.backend_choice = BackendChoice(backend.name, self.backend_choice.reason)
        else:
            backend, self.backend_choice = build_backend(self.backend_choice, *args)
        if hasattr(backend, "warm_up"):  # e.g. capture CUDA graphs before the first request
            backend.warm_up()
        return backend

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, settings: EngineSettings | None = None,
                       progress: Callable[[int, int], None] | None = None) -> Engine:
        from northcode.model.checkpoint import load_checkpoint
        from northcode.paths import model_display_name

        settings = settings or EngineSettings()
        device = resolve_device(settings.device)
        dtype = resolve_dtype(settings.dtype, device)
        config, weights = load_checkpoint(model_dir, device=device, dtype=dtype, progress=progress)
        tokenizer = Tokenizer.from_dir(model_dir)
        return cls(config, weights, tokenizer, settings, model_name=model_display_name(model_dir))

    # --- the API (any thread) ---

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they come; ValueError before the first for a bad request.
        Closing the iterator early (client gone) aborts the request."""
        params = params or SamplingParams()
        request = self._make_request(request_id, list(prompt_token_ids), params, asyncio.get_running_loop())
        finished = False
        try:
            while not finished:
                output = await request.queue.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    def _make_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      loop: asyncio.AbstractEventLoop) -> _Request:
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
                request = _Request(Sequence(request_id, prompt_ids, params, seed, max_new, 0), asyncio.Queue(),
                                   loop, None, StopStringFilter([]), ended=True)
                request.queue.put_nowait(self._final_output(request, "error", self.fatal_error))
                return request
            if request_id in self._ids:
                raise ValueError(f"request_id {request_id!r} is already running")
            self._arrivals += 1
            sequence = Sequence(request_id, prompt_ids, params, seed, max_new, self._arrivals)
            detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens) if self.tokenizer else None
            request = _Request(sequence, asyncio.Queue(), loop, detokenizer, StopStringFilter(params.stop))
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
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self.fatal_error is None:  # a thread blocked on a lost device never comes back: do not wait for it
            self._thread.join(timeout=30)
        if self._watchdog is not None:
            self._watchdog.close()

    # --- the step thread ---

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._stopping or self._inbox or self._aborts or self.scheduler.has_work
                           or self._launched is not None):
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
            failure = self._attempt(self._step)  # outside any except block: the failed step's frames are gone
            if failure is not None:
                if self.fatal_error is not None:
                    return  # the device was declared lost while this thread was blocked: touch nothing
                self._after_failed_step(failure)
            self._publish_stats()
        if self.fatal_error is None:
            for request in list(self._requests.values()):
                self._finish(request, "abort", None)

    def _step(self) -> None:
        pipelined = self._pipelined()
        if self._launched is not None and not pipelined:
            self._drain()  # a request that needs the host's history arrived: read the step in flight first
        plan = self.scheduler.schedule()
        if plan.is_empty and self._launched is None:  # only waiting requests, none admissible yet: do not spin
            time.sleep(0.001)
            return
        launched = self._launched.sequences if self._launched else []
        self._in_step = plan.decodes + [c.sequence for c in plan.prefills] + launched
        shapes = step_shapes(plan, self.settings.page_size, self.max_pages_per_seq)
        if pipelined:  # (sequence, token, logprob) of the prefills and of the decode launched last step
            sampled, self._launched = self._guarded(lambda: self._pipelined_model_step(plan), shapes, plan)
        else:
            sampled = self._guarded(lambda: self._prefill(plan) + self._decode(plan), shapes, plan)
        self._shapes_seen |= shapes
        self._in_step = []
        self.scheduler.commit(plan)
        for seq in self._launched.sequences if self._launched else []:
            seq.in_flight += 1
        now = time.perf_counter()
        for seq, token, logprob in sampled:
            self._append(self._requests[seq.request_id], token, logprob, now)

    def _guarded(self, work: Callable[[], object], shapes: set[tuple], plan: StepPlan | None):
        """work() under the step watchdog (the long limit for a shape not run before); StepAbandoned when
        the watchdog gave it up, its exception when it raised."""
        limit = self.settings.step_timeout_s
        if shapes - self._shapes_seen:  # a new shape may capture a graph or compile: the long limit
            limit = limit and max(limit, self.settings.first_step_timeout_s)
        error = result = None
        if self._watchdog is not None:
            what = describe_step(plan) if plan and not plan.is_empty else "read of the decode step in flight"
            self._watchdog.begin(limit, what)
        try:
            result = work()
        except Exception as err:
            error = err
        try:
            if self._watchdog is not None and self._watchdog.end():
                raise StepAbandoned
            if error is not None:
                raise error
        finally:
            error = None  # this frame is in the error's traceback: no cycle keeps the backend's frames alive
        return result

    def _rows(self, sequences: list[Sequence]) -> list[SamplingRow]:
        return [SamplingRow(s.params, s.seed, s.prompt_ids, s.output_ids) for s in sequences]

    def _prefill(self, plan: StepPlan) -> list[tuple[Sequence, int, TokenLogprob | None]]:
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
        result = self.sampler.sample(logits[keep], self._rows(sequences))
        return list(zip(sequences, result.token_ids, result.logprobs))

    def _decode(self, plan: StepPlan) -> list[tuple[Sequence, int, TokenLogprob | None]]:
        """One decode step for every decoding row. The backend samples every row it can (so a seeded request
        draws the same tokens whatever shares its step: issue 3); the engine's Sampler samples the others from
        the logits, which come back only when needed (logprobs, or rows the backend cannot sample)."""
        sequences = plan.decodes
        if not sequences:
            return []
        kv, rows = self.kv, self._rows(sequences)
        on_device = [self.backend.can_sample(s.params) for s in sequences]
        want_logprobs = any(s.params.logprobs is not None for s in sequences)
        batch = DecodeBatch([s.row for s in sequences], [s.last_token for s in sequences],
                            [s.num_computed for s in sequences], rows, sample=any(on_device),
                            return_logits=want_logprobs or not all(on_device), block_tables=kv.block_tables,
                            tables_version=kv.version, tables_columns=kv.high_water)
        result = self.backend.decode(batch)
        assert not batch.sample or result.token_ids is not None, f"{self.backend.name} backend returned no tokens"
        tokens = list(result.token_ids) if batch.sample else [-1] * len(rows)
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        host = [b for b, ok in enumerate(on_device) if not ok]  # sampled here, with their penalties
        if host:
            sample = self.sampler.sample(_rows_of(result.logits, host), [rows[b] for b in host])
            for b, token, logprob in zip(host, sample.token_ids, sample.logprobs):
                tokens[b], logprobs[b] = token, logprob
        scored = [b for b, ok in enumerate(on_device) if ok and rows[b].params.logprobs is not None]
        if scored:  # logprobs of tokens the backend chose
            found = self.sampler.logprobs(_rows_of(result.logits, scored), [rows[b] for b in scored],
                                          [tokens[b] for b in scored])
            for b, logprob in zip(scored, found):
                logprobs[b] = logprob
        return list(zip(sequences, tokens, logprobs))

    def _append(self, request: _Request, token: int, logprob: TokenLogprob | None, now: float) -> None:
        """Record one sampled token; emit its text (held back where a stop string may begin); finish."""
        seq = request.sequence
        seq.output_ids.append(token)
        if request.last_token_at is None:
            request.time_to_first_token = now - seq.submitted_at
        else:
            request.latencies.append(now - request.last_token_at)
        request.last_token_at = now
        params = seq.params
        reason, stop_reason = None, None
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.config.eos_token_ids):
            reason, stop_reason = "stop", token
        text, matched = request.stops.push(request.detokenizer.push(token) if request.detokenizer else "")
        if matched is not None:
            reason, stop_reason = "stop", matched
        elif reason is None and len(seq.output_ids) >= seq.max_new_tokens:
            reason = "length"
        if reason is None:
            request.emit(RequestOutput(seq.request_id, [token], text, [logprob] if logprob else None))
        else:
            self._finish(request, reason, stop_reason, [token], text, [logprob] if logprob else None)

    def _finish(self, request: _Request, reason: str, stop_reason: str | int | None, token_ids: list[int] | None = None,
                text: str = "", logprobs: list[TokenLogprob] | None = None, error: str | None = None) -> None:
        seq = request.sequence
        if reason in ("length", "stop") and not isinstance(stop_reason, str):  # release held-back text
            tail, matched = request.stops.push(request.detokenizer.flush() if request.detokenizer else "")
            text += tail
            if matched is not None:
                reason, stop_reason = "stop", matched
            else:
                text += request.stops.flush()
        self.scheduler.finish(seq)
        del self._requests[seq.request_id]
        with self._lock:
            self._ids.discard(seq.request_id)
        self._publish_stats()  # before the final output: a caller that saw it sees the pages freed
        request.emit(self._final_output(request, reason, error, stop_reason, token_ids, text, logprobs))

    @staticmethod
    def _final_output(request: _Request, reason: str, error: str | None = None, stop_reason: str | int | None = None,
                      token_ids: list[int] | None = None, text: str = "",
                      logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        seq = request.sequence
        timings = Timings(queued_s=(seq.first_scheduled_at or time.perf_counter()) - seq.submitted_at,
                          time_to_first_token_s=request.time_to_first_token, token_latencies_s=list(request.latencies))
        usage = Usage(len(seq.prompt_ids), len(seq.output_ids), seq.num_cached_tokens)
        return RequestOutput(seq.request_id, token_ids or [], text, logprobs, finished=True, finish_reason=reason,
                             stop_reason=stop_reason, error=error, usage=usage, timings=timings)

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

