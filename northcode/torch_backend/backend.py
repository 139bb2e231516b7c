"""TorchBackend: prefill and decode of cohere2_moe in PyTorch, on the paged KV cache (engine/backend.py protocol).

What it owns: the weights in the layout its kernels want (per layer one fused weight of the QKV rows in
slot-major order plus, on sparse layers, the router's rows; a fused gate_up for dense layers; everything
else is the canonical tensors), the KV pools (K and
V are the two halves of one tensor `kv_pool [2, num_pages + 1, page_size, Hkv, D]`, so one gather reads
both; `k_pool`, `v_pool` are its halves, in the layout of docs/architecture.md), the device copy of the
block tables (row max_batch stays -1 for padded decode rows, which write the scratch page) with its
translation `page_of` (long, scratch for -1: what the decode step indexes the pool with), and the CUDA
graphs of the decode step.
  - prefill (paged_prefill.py) runs each chunk eagerly; `warm_up` runs one chunk of each length bucket first
    (on a GPU), since CUDA loads a kernel at its first launch and short chunks pick kernels long ones do not;
  - decode (decode_step.py) runs one step in a CUDA graph per (batch bucket, context bucket) over static
    input buffers on a GPU, eagerly on the CPU; the same code either way. Context buckets grow by an
    eighth of an octave (16, 18, 20, ... pages), so a graph reads at most ~12% more pages than needed.
    With compile on (the default with CUDA graphs on a GPU; NORTHCODE_TORCH_COMPILE=0/1 or compile= decide) it is
    compiled_step.py's torch.compile'd one instead: compiled and checked against the eager step per batch
    bucket at warm-up, one graph per batch bucket for every context (key (bucket, ANY_CONTEXT)); a compile
    that fails is logged once (`compile_failure`) and the eager step decodes from then on.
  - launch_decode enqueues the same step for the engine's pipeline, with no read of the device from the host
    before `result()`: host inputs go up through pinned memory, carried rows take the previous launch's
    tokens with one gather on the device (engine/device.py), the rows are sampled on the device, and the
    tokens start a non-blocking copy to pinned memory behind a CUDA event, so the GPU runs step n+1 while
    the host reads step n (on the CPU the same code runs at once).
  Both run the model through `decode_logits` (the one place tests inject hangs and failures).
A graph is captured on the backend's own stream after two warm-up steps there, with the garbage collector
run first and held off meanwhile: a dead backend's graphs destroyed in the middle of a capture invalidate it.
Each captured graph holds its backend, so a backend with graphs (a GPU's) is freed by the cyclic collector,
which a capture holds off; the other helpers (prefill, decode step, compiled step) hold it through a weak
proxy, so a backend without graphs (the CPU's, the megakernel's prefiller) is freed, pools with it, as soon as
nothing refers to it. A capture that fails anyway is undone, logged and kept in
`capture_failures`; that (batch, context) bucket then runs eagerly.
decode and launch_decode sample every row with the device draw (engine/sampling.sample_on_device), the
constrained rows' token masks applied first (asked for once the model step is enqueued); the engine's Sampler
samples the rows with penalties or logprobs from the logits decode returns.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import weakref

import torch
import torch.nn.functional as F

from northcode.config import ModelConfig
from northcode.engine.backend import (DecodeBatch, DecodeResult, PrefillBatch, check_launch, context_bucket,
                                      next_power_of_two)
from northcode.engine.device import DeviceBlockTables, PendingTokens, carried_tokens, to_device
from northcode.engine.kv_cache import page_bytes
from northcode.engine.sampling import apply_token_masks, sample_on_device
from northcode.model.model import check_weights, layer_weights, rope_inv_freq
from northcode.torch_backend.compiled_step import CompiledDecode, compile_requested
from northcode.torch_backend.decode_step import DecodeStep, slot_major_qkv
from northcode.torch_backend.paged_prefill import ChunkPrefill
from northcode.torch_backend.routed_experts import choose_moe_path

log = logging.getLogger(__name__)
WARM_UP_CHUNK_TOKENS = 1024  # warm_up_prefill runs chunks of 1, 2, 4, ... this many tokens (2047 in all)
WARM_UP_CONTEXT = 4096  # cached tokens before each warm-up chunk: the attention shapes of an agent's next turn
ANY_CONTEXT = 0  # the context part of a compiled step's graph key: one graph serves every context length


class LaunchedDecode(PendingTokens):
    """engine/backend.py's PendingDecode for a TorchBackend launch: the sampled tokens' copy to the host."""

    def result(self) -> DecodeResult:
        """The host token ids, once copied."""
        return DecodeResult(self.host_values(), None)


class TorchBackend:
    name = "torch"

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], num_pages: int, page_size: int,
                 max_batch: int, max_pages_per_seq: int, cuda_graphs: bool = True, compile: bool | None = None) -> None:
        """compile: torch.compile the decode step (compiled_step.py); None: NORTHCODE_TORCH_COMPILE, else on with
        CUDA graphs on a GPU (compiled_step.compile_requested). A compile that fails or disagrees with the eager step at
        warm-up is logged once (compile_failure) and the eager step decodes instead."""
        check_weights(config, weights)
        self.config = config
        self.embed = weights["model.embed_tokens.weight"]  # [V, H]
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.final_norm, self.lm_head = weights["model.norm.weight"], weights["lm_head.weight"]
        self.layers = []  # model.LayerWeights; q/k/v_proj dropped: the fused copy replaces them
        # per layer [Hq*D + 2*Hkv*D (+ E), H]: QKV in decode_step.slot_major_qkv's order, then on sparse layers
        # the router's rows (one GEMM for both: both read the normed input)
        self.qkv_proj: list[torch.Tensor] = []
        self.qkv_size = config.q_size + 2 * config.kv_size
        self.dense_gate_up: dict[int, torch.Tensor] = {}  # dense layer -> [2*I_dense, H] (gate rows, up rows)
        for i in range(config.num_hidden_layers):
            layer = layer_weights(config, weights, i)
            fused = slot_major_qkv(layer.q_proj, layer.k_proj, layer.v_proj, config.num_key_value_heads)
            self.qkv_proj.append(fused if config.is_dense(i) else torch.cat([fused, layer.router]))
            if config.is_dense(i):
                self.dense_gate_up[i] = torch.cat([layer.gate_proj, layer.up_proj])
            self.layers.append(dataclasses.replace(layer, q_proj=None, k_proj=None, v_proj=None))
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta).to(self.device)  # [D/2] fp32
        self.page_size, self.max_batch, self.max_pages_per_seq = page_size, max_batch, max_pages_per_seq
        self.scratch_page = num_pages  # the pool's last page
        self.kv_pool = torch.zeros((2, num_pages + 1, page_size, config.num_key_value_heads, config.head_dim),
                                   dtype=self.dtype, device=self.device)
        self.k_pool, self.v_pool = self.kv_pool[0], self.kv_pool[1]  # each contiguous [num_pages + 1, ps, Hkv, D]
        assert page_bytes(config, page_size, self.dtype) * (num_pages + 1) == self.kv_pool.nbytes
        # the device block tables (the megakernel reads the same ones): int32 `tables`, long `page_of`
        self.device_tables = DeviceBlockTables(config.num_hidden_layers, max_batch, max_pages_per_seq,
                                               self.scratch_page, self.device)
        self.tables, self.page_of = self.device_tables.tables, self.device_tables.page_of
        self.moe_path = choose_moe_path(self.device, self.dtype)  # decode
        self.prefill_moe_path = "grouped" if self.device.type == "cpu" or self.dtype == torch.bfloat16 else "loop"
        self.use_graphs = cuda_graphs and self.device.type == "cuda"
        self.graphs: dict[tuple[int, int], _DecodeGraph] = {}  # (batch bucket, context pages) -> graph
        self.capture_failures: dict[tuple[int, int], str] = {}  # the same keys -> the error; run eagerly
        self.graph_pool = None
        self.capture_stream = torch.cuda.Stream(self.device) if self.use_graphs else None  # warm-up and capture
        self.last_launch_tokens: torch.Tensor | None = None  # device long [B]: what launch_decode sampled last
        this = weakref.proxy(self)  # the helpers' reference back: no cycle keeps a dropped backend's pools
        self.prefiller = ChunkPrefill(this)
        self.decoder = DecodeStep(this)  # its prepare / layer are what the GPU tests teacher-force
        self.compiled = CompiledDecode(this) if compile_requested(compile, self.device, cuda_graphs) else None
        self.compile_failure: str | None = None  # why compile was given up, if it was
        # (token_ids, positions, rows, num_full_pages) -> logits: the compiled step, or the eager one
        self.decode_step = self.compiled if self.compiled is not None else self.decoder.__call__

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """model.norm in one fused kernel: fp32 statistics, the result in x's dtype. x [..., H]."""
        cfg = self.config
        if cfg.uses_rms_norm:
            return F.rms_norm(x, (x.shape[-1],), weight, cfg.norm_eps)
        return F.layer_norm(x, (x.shape[-1],), weight, None, cfg.norm_eps)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm, LM head, logit_scale: x [N, H] -> fp32 [N, V] (model.lm_logits)."""
        logits = F.linear(self.norm(x, self.final_norm), self.lm_head)
        if self.config.logit_scale != 1.0:
            logits = logits * self.config.logit_scale
        return logits.float()

    @torch.inference_mode()
    def prefill(self, batch: PrefillBatch) -> torch.Tensor:
        """Each chunk runs alone: its tokens attend to each other and to the row's cached pages."""
        self.device_tables.upload(batch.block_tables, batch.tables_version, batch.tables_columns)
        last_hidden = [self.prefiller.forward(to_device(torch.tensor(chunk.token_ids), self.device), chunk.start,
                                              chunk.row)[-1] for chunk in batch.chunks]
        return self.logits(torch.stack(last_hidden))

    @torch.inference_mode()
    def decode(self, batch: DecodeBatch) -> DecodeResult:
        self.last_launch_tokens = None  # a later launch can carry nothing across this step
        inputs = to_device(torch.tensor(batch.token_ids, dtype=torch.long), self.device)  # [B]
        logits = apply_token_masks(self.decode_logits(batch, inputs), batch.masks(), inputs)  # masks: while it runs
        token_ids = sample_on_device(logits, batch.sampling).tolist() if batch.sample else None
        return DecodeResult(token_ids, logits if batch.return_logits else None)

    @torch.inference_mode()
    def launch_decode(self, batch: DecodeBatch, carry: list[int]) -> LaunchedDecode:
        """Enqueue one decode step and its sampling; return without reading the device (engine/backend.py).
        carry[b] >= 0: row b feeds the token row carry[b] of the previous launch sampled."""
        previous = self.last_launch_tokens
        check_launch(batch, carry, None if previous is None else previous.shape[0])
        token_ids = carried_tokens(batch.token_ids, carry, previous, self.device)  # device long [B]
        logits = apply_token_masks(self.decode_logits(batch, token_ids), batch.masks(), token_ids)  # while it runs
        tokens = sample_on_device(logits, batch.sampling)
        self.last_launch_tokens = tokens
        return LaunchedDecode(tokens)

    def decode_logits(self, batch: DecodeBatch, token_ids: torch.Tensor) -> torch.Tensor:
        """[B, V] fp32 logits of one decode step (in a CUDA graph on a GPU); token_ids: device long [B].
        The model step of both decode and launch_decode: where tests inject hangs and failures."""
        self.device_tables.upload(batch.block_tables, batch.tables_version, batch.tables_columns)
        num_rows = len(batch.rows)
        bucketed = self.use_graphs or self.compiled is not None  # a compiled step has static shapes too
        bucket = min(next_power_of_two(num_rows), self.max_batch) if bucketed else num_rows
        if self.compiled is not None and bucket not in self.compiled.ready:
            self._compile(bucket)  # not warmed up (warm_up compiles every bucket)
        context_pages = -(-(max(batch.positions) + 1) // self.page_size)
        num_full_pages = context_pages  # eager: exactly the pages needed; graphs: a bucket of them
        if self.compiled is not None:
            num_full_pages = ANY_CONTEXT
        elif self.use_graphs:
            num_full_pages = context_bucket(context_pages, self.max_pages_per_seq)
        pad = bucket - num_rows
        token_ids = F.pad(token_ids, (0, pad))  # padded rows feed token 0 at position 0 of the scratch row
        positions = to_device(torch.tensor(batch.positions + [0] * pad), self.device)
        rows = to_device(torch.tensor(batch.rows + [self.max_batch] * pad), self.device)
        key = (bucket, num_full_pages)
        graph = self.graphs.get(key)
        if self.use_graphs and graph is None and key not in self.capture_failures:
            graph = self._capture(bucket, num_full_pages)
        if graph is None:  # no graphs, or this bucket's capture failed
            return self.decode_step(token_ids, positions, rows, num_full_pages)[:num_rows]
        return graph.run(token_ids, positions, rows)[:num_rows].clone()

    @torch.inference_mode()  # as decode and launch_decode: compiled graphs are kept per grad mode
    def warm_up(self) -> None:
        """Before serving: on a GPU, one prefill chunk per length bucket (warm_up_prefill); for every batch bucket,
        compile the step (when compile is on) and capture its decode graph, so no request pays for any of it.
        A compiled step's graph serves every context; the eager step's are captured here at the smallest
        context (longer contexts capture their bucket on first use)."""
        if self.device.type == "cuda":
            self.warm_up_prefill()
        buckets = sorted({min(next_power_of_two(n), self.max_batch) for n in range(1, self.max_batch + 1)})
        for bucket in buckets:
            if self.compiled is not None and bucket not in self.compiled.ready:
                self._compile(bucket)
        if not self.use_graphs:
            return
        for bucket in buckets:
            pages = ANY_CONTEXT if self.compiled is not None else context_bucket(1, self.max_pages_per_seq)
            if (bucket, pages) not in self.graphs and (bucket, pages) not in self.capture_failures:
                self._capture(bucket, pages)

    @torch.inference_mode()
    def warm_up_prefill(self) -> None:
        """One prefill chunk of each length 1, 2, 4, ... WARM_UP_CHUNK_TOKENS after WARM_UP_CONTEXT positions
        (both capped by a row's table), so that no request pays the first launch of a kernel that only short
        chunks pick (small-M GEMMs, the small sort of the MoE pairs; CUDA loads a kernel at its first launch):
        the first short turn after a long prompt would. It runs on the padding row with every page mapped to
        the scratch page (finite keys, no live page touched); after, the row is unmapped and that page zeroed."""
        ps, row = self.page_size, self.max_batch
        longest = self.max_pages_per_seq * ps  # positions one row's table holds
        self.tables[:, row] = self.scratch_page
        try:
            for length in (1 << i for i in range(WARM_UP_CHUNK_TOKENS.bit_length())):
                if length > longest:
                    break
                start = min(WARM_UP_CONTEXT, longest - length) // ps * ps
                tokens = torch.arange(length, device=self.device) % self.config.vocab_size  # [T]
                self.logits(self.prefiller.forward(tokens, start, row)[-1:])  # [1, V]: the LM head's shape too
        finally:
            self.tables[:, row] = -1
            self.kv_pool[:, self.scratch_page].zero_()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # its kernels run now, not in the first request's time

    def _compile(self, bucket: int) -> None:
        """Compile (and check) the step of a batch bucket; on any failure warn once and decode with the eager
        step from then on (the compiled graphs captured so far are dropped)."""
        try:
            seconds = self.compiled.compile_bucket(bucket)
            log.info("compiled the decode step for batch %d in %.1f s", bucket, seconds)
        except Exception as err:  # whatever inductor, triton or the check raised: the eager step is correct
            self.compile_failure = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:300]}"
            log.warning("torch.compile of the decode step failed for batch %d (%s); decoding with the eager step",
                        bucket, self.compile_failure)
            log.info("the compile's error in full (its end):\n%s", str(err)[-3000:])  # a worker's traceback
            self.compiled = None
            self.decode_step = self.decoder.__call__
            self.graphs = {key: graph for key, graph in self.graphs.items() if key[1] != ANY_CONTEXT}

    def _capture(self, bucket: int, num_full_pages: int) -> _DecodeGraph | None:
        """The decode graph of a (batch bucket, context pages) pair, or None when its capture failed (logged,
        kept in capture_failures: the bucket then runs eagerly). A failing warm-up step raises: then the
        step itself is broken, not its capture."""
        key = (bucket, num_full_pages)
        log.info("capturing the decode graph for batch %d, %s", bucket, "compiled, every context"
                 if num_full_pages == ANY_CONTEXT else f"{num_full_pages} context pages")
        graph = _DecodeGraph(self, bucket, num_full_pages)
        graph.warm_up()
        try:
            graph.capture()
        except Exception as err:  # whatever the capture raised: this bucket decodes eagerly
            self.capture_failures[key] = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
            log.warning("decode graph for batch %d, %d context pages not captured (%s); it runs eagerly",
                        bucket, num_full_pages, self.capture_failures[key])
            return None
        self.graphs[key] = graph
        return graph


class _DecodeGraph:
    """One decode step over static input buffers, captured on the backend's capture stream; `run` copies
    inputs in and replays."""

    def __init__(self, backend: TorchBackend, batch: int, num_full_pages: int) -> None:
        self.backend, self.num_full_pages = backend, num_full_pages
        device = backend.device
        self.token_ids = torch.zeros(batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        self.rows = torch.full((batch,), backend.max_batch, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def step(self) -> torch.Tensor:
        return self.backend.decode_step(self.token_ids, self.positions, self.rows, self.num_full_pages)

    def warm_up(self) -> None:
        """Two eager steps on the capture stream (allocator, lazy kernels, cuBLAS state of that stream)."""
        stream = self.backend.capture_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.step()
        torch.cuda.current_stream().wait_stream(stream)

    def capture(self) -> None:
        """Capture one step; on failure undo what the capture left behind, then raise."""
        backend = self.backend
        self.graph = torch.cuda.CUDAGraph()
        gc.collect()  # dead graphs are destroyed now, not by a collection in the middle of the capture
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(self.graph, pool=backend.graph_pool, stream=backend.capture_stream):
                self.logits = self.step()
        except BaseException:
            self.graph.reset()
            self.graph = None
            try:
                reset_capturing_generator(backend.device)
            except Exception:  # keep the capture's own error; say that random ops may now fail
                log.exception("the default CUDA generator could not be reset after a failed capture")
            raise
        finally:
            if collecting:
                gc.enable()
        backend.graph_pool = self.graph.pool()

    def run(self, token_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Inputs: device long [batch] each; device-to-device copies into the static inputs, then replay."""
        self.token_ids.copy_(token_ids)
        self.positions.copy_(positions)
        self.rows.copy_(rows)
        self.graph.replay()
        return self.logits


def reset_capturing_generator(device: torch.device) -> None:
    """After a failed capture: give the device's default CUDA generator a copy of its state that is not
    capturing. The capture began its capture bookkeeping and never ended it, and torch (2.11) then refuses
    every later random op on the default generator ("Offset increment outside graph capture")."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    generator = torch.cuda.default_generators[index]
    generator.graphsafe_set_state(generator.clone_state())
