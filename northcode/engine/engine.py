"""Engine: owns the KV cache, scheduler, backend and sampler; runs the step loop in its own thread.

The server's API (docs/architecture.md): `async generate(request_id, prompt_ids, params)` yields
RequestOutputs (the last has finished=True, usage and timings), `abort(request_id)` from any thread,
`stats()`, `shutdown()`. Threads: the event loop only validates and enqueues; the step thread owns
every mutable part (scheduler, pages, sequences) and hands outputs back through
`loop.call_soon_threadsafe` into one asyncio.Queue per request, so the event loop never blocks.
A step: schedule -> prefill chunks -> one decode step for all decoding rows -> sample -> detokenise,
check stops -> emit. It knows nothing of HTTP or chat templates.
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
from northcode.engine.kv_cache import KVCacheManager, page_bytes
from northcode.engine.request import RequestOutput, SamplingParams, Timings, TokenLogprob, Usage
from northcode.engine.sampling import Sampler, SamplingRow, StopStringFilter
from northcode.engine.scheduler import Scheduler, Sequence, StepPlan
from northcode.engine.settings import EngineSettings
from northcode.engine.tokenizer import IncrementalDetokenizer, Tokenizer

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


def build_backend(config: ModelConfig, weights: dict[str, torch.Tensor], settings: EngineSettings, num_pages: int,
                  max_pages_per_seq: int) -> ModelBackend:
    """The backend that settings.backend names. Every backend takes the same arguments (backend.py)."""
    if settings.backend == "megakernel":
        try:
            from northcode.engine.megakernel import MegakernelBackend
        except ImportError as err:
            raise ValueError(f"engine setting backend = 'megakernel': not available ({err})") from None
        return MegakernelBackend(config, weights, num_pages, settings.page_size, settings.max_batch,
                                 max_pages_per_seq, cuda_graphs=settings.cuda_graphs)
    from northcode.engine.torch_backend import TorchBackend

    return TorchBackend(config, weights, num_pages, settings.page_size, settings.max_batch, max_pages_per_seq,
                        cuda_graphs=settings.cuda_graphs, compile=settings.compile)


class Engine:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: Tokenizer | None,
                 settings: EngineSettings | None = None, model_name: str = "model",
                 backend: ModelBackend | None = None) -> None:
        self.settings = settings = settings or EngineSettings()
        self.config, self.tokenizer, self.model_name = config, tokenizer, model_name
        device = weights["model.embed_tokens.weight"].device
        dtype = weights["model.embed_tokens.weight"].dtype
        num_pages = kv_page_budget(config, settings, dtype, device)
        probe = KVCacheManager(config, num_pages, settings.page_size, 1, 1)
        self.max_model_len = context_limit(config, settings, probe)
        if self.max_model_len < 2:
            raise ValueError(f"the KV pool of {num_pages} pages cannot hold even a 2-token sequence")
        max_pages_per_seq = -(-self.max_model_len // settings.page_size)
        self.kv = KVCacheManager(config, num_pages, settings.page_size, settings.max_batch, max_pages_per_seq,
                                 settings.enable_prefix_cache)
        self.scheduler = Scheduler(self.kv, settings.max_batch, settings.chunk_size, self.max_model_len)
        self.backend = backend or build_backend(config, weights, settings, num_pages, max_pages_per_seq)
        if hasattr(self.backend, "warm_up"):  # e.g. capture CUDA graphs before the first request
            self.backend.warm_up()
        self.sampler = Sampler()
        self._seeds = random.Random(settings.seed) if settings.seed is not None else random.SystemRandom()
        self._arrivals = 0
        self._lock = threading.Condition()
        self._inbox: list[_Request] = []
        self._aborts: list[str] = []
        self._requests: dict[str, _Request] = {}  # step thread only
        self._ids: set[str] = set()  # ids submitted and not yet finished (any thread, under the lock)
        self._stats: dict[str, float] = {}
        self._stopping = False
        self._publish_stats()
        self._thread = threading.Thread(target=self._loop, name="northcode-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, settings: EngineSettings | None = None,
                       progress: Callable[[int, int], None] | None = None) -> Engine:
        from northcode.engine.checkpoint import load_checkpoint
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
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer, and this engine has none")
        bad = next((t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < self.config.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: {bad!r} is not a token id (vocabulary of {self.config.vocab_size})")
        max_new = min(params.max_tokens, self.max_model_len - len(prompt_ids))
        self.scheduler.check_fits(len(prompt_ids), max(1, max_new))
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        with self._lock:
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

    def stats(self) -> dict[str, float]:
        with self._lock:
            return dict(self._stats)

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()
        self._thread.join(timeout=30)

    # --- the step thread ---

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._stopping or self._inbox or self._aborts or self.scheduler.has_work):
                    self._lock.wait(IDLE_WAIT_S)
                if self._stopping:
                    break
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
            for request in inbox:
                self._requests[request.sequence.request_id] = request
                self.scheduler.add(request.sequence)  # checked by _make_request: cannot fail
            for request_id in aborts:
                if request_id in self._requests:
                    self._finish(self._requests[request_id], "abort", None)
            try:
                self._step()
            except Exception as err:  # a failed step ends the running requests with the error, not a hang
                log.exception("engine step failed")
                self._fail_all(f"{type(err).__name__}: {err}")
            self._publish_stats()
        for request in list(self._requests.values()):
            self._finish(request, "abort", None)

    def _step(self) -> None:
        plan = self.scheduler.schedule()
        if plan.is_empty:  # only waiting requests, none admissible yet: do not spin
            time.sleep(0.001)
            return
        sampled = self._prefill(plan) + self._decode(plan)  # (sequence, token, logprob)
        self.scheduler.commit(plan)
        now = time.perf_counter()
        for seq, token, logprob in sampled:
            self._append(self._requests[seq.request_id], token, logprob, now)

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
        """One decode step for every decoding row. The backend samples when it can sample every row;
        logits come back only when needed (logprobs, or rows the backend cannot sample)."""
        sequences = plan.decodes
        if not sequences:
            return []
        kv, rows = self.kv, self._rows(sequences)
        on_device = all(self.backend.can_sample(s.params) for s in sequences)
        want_logprobs = any(s.params.logprobs is not None for s in sequences)
        batch = DecodeBatch([s.row for s in sequences], [s.last_token for s in sequences],
                            [s.num_computed for s in sequences], rows, sample=on_device,
                            return_logits=want_logprobs or not on_device, block_tables=kv.block_tables,
                            tables_version=kv.version, tables_columns=kv.high_water)
        result = self.backend.decode(batch)
        if on_device:
            assert result.token_ids is not None, f"{self.backend.name} backend returned no tokens"
            logprobs = self.sampler.logprobs(result.logits, rows, result.token_ids) if want_logprobs else [None] * len(rows)
            return list(zip(sequences, result.token_ids, logprobs))
        sample = self.sampler.sample(result.logits, rows)
        return list(zip(sequences, sample.token_ids, sample.logprobs))

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
        timings = Timings(queued_s=(seq.first_scheduled_at or time.perf_counter()) - seq.submitted_at,
                          time_to_first_token_s=request.time_to_first_token, token_latencies_s=request.latencies)
        usage = Usage(len(seq.prompt_ids), len(seq.output_ids), seq.num_cached_tokens)
        self._publish_stats()  # before the final output: a caller that saw it sees the pages freed
        request.emit(RequestOutput(seq.request_id, token_ids or [], text, logprobs, finished=True,
                                   finish_reason=reason, stop_reason=stop_reason, error=error,
                                   usage=usage, timings=timings))

    def _fail_all(self, message: str) -> None:
        for request in list(self._requests.values()):
            self._finish(request, "error", None, error=message)

    def _publish_stats(self) -> None:
        kv, scheduler = self.kv, self.scheduler
        queried = kv.stats.queried_tokens
        stats = {
            "pages_used": kv.num_used_pages, "pages_total": kv.pool.num_pages,
            "prefix_cache_hit_tokens": kv.stats.hit_tokens, "prefix_cache_queried_tokens": queried,
            "prefix_cache_hit_rate": kv.stats.hit_tokens / queried if queried else 0.0,
            "requests_running": len(scheduler.running), "requests_waiting": len(scheduler.waiting),
            "preemptions": scheduler.num_preemptions, "max_batch": self.settings.max_batch, "page_size": self.settings.page_size,
        }
        with self._lock:
            self._stats = stats

