"""TorchBackend: prefill and decode of cohere2_moe in PyTorch, on the paged KV cache (backend.py protocol).

The math is model.py's building blocks (norm, rope, qkv, router, SwiGLU, LM head); what this file adds
is the paged attention and a batched MoE. Attention gathers the pages a row needs (sliding layers only
the window's pages, full layers all) from `k_pool, v_pool` and masks by position; K/V of new tokens are
scattered into their slots first. The MoE sorts (token, expert) pairs by expert and runs two grouped
GEMMs (F.grouped_mm), so only chosen experts' weights are read and no host sync is needed.
On a GPU the decode step runs in a CUDA graph per (batch bucket, context bucket) over static buffers;
padded rows read block-table row `max_batch` (all -1) and write the scratch page. On the CPU the same
code runs eagerly. It samples with the PyTorch sampler (sampling.py) on the same device, after the step.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F

from northcode.config import ModelConfig
from northcode.engine.backend import DecodeBatch, DecodeResult, PrefillBatch
from northcode.engine.kv_cache import allocate_kv_pools
from northcode.engine.model import (LayerWeights, apply_rope, check_weights, layer_weights, lm_logits, norm,
                                    rope_cos_sin, rope_inv_freq, route, swiglu)
from northcode.engine.request import SamplingParams
from northcode.engine.sampling import Sampler

log = logging.getLogger(__name__)
MIN_CONTEXT_PAGES = 4  # smallest context bucket of the decode graphs (pages of full layers)
SCORE_BUDGET_BYTES = 1 << 30  # fp32 attention scores of one prefill block at most: long contexts stay in memory


_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm  # public from torch 2.10 on


def _expert_matmuls(x: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    offsets: torch.Tensor) -> torch.Tensor:
    """SwiGLU of row i of x [M, H] through expert expert_ids[i] (rows sorted by expert; offsets [E] end
    each expert's group) -> [M, H]. Grouped GEMMs read only the chosen experts; CUDA's grouped GEMM
    takes bf16 only, so other CUDA dtypes gather the chosen experts' weights (fine for small models)."""
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        if not torch.cuda.is_current_stream_capturing():  # one expert at a time (syncs: prefill only)
            bounds = [0] + offsets.tolist()
            return torch.cat([swiglu(x[a:b], *gate_up[e].chunk(2, dim=0), down[e])
                              for e, (a, b) in enumerate(zip(bounds, bounds[1:])) if b > a])
        hidden = torch.bmm(gate_up[expert_ids], x[:, :, None])[:, :, 0]  # [M, 2I]: decode rows only
        gate, up = hidden.chunk(2, dim=-1)
        return torch.bmm(down[expert_ids], (F.silu(gate) * up)[:, :, None])[:, :, 0]
    gate, up = _grouped_mm(x, gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)  # [M, I] each
    return _grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offsets)


def batched_moe(h: torch.Tensor, layer: LayerWeights, config: ModelConfig) -> torch.Tensor:
    """Routed experts (plus shared ones) for h: [N, H] -> [N, H], over the (token, expert) pairs sorted
    by expert, with no host sync. Each token's contributions are added in ascending expert order, as
    in model.py."""
    weights, expert_ids = route(h, layer.router, config)  # [N, k], [N, k]
    k = expert_ids.shape[1]
    flat_ids = expert_ids.flatten()  # [N*k]
    order = flat_ids.argsort(stable=True)  # pairs grouped by expert id
    token_idx = order // k  # [N*k] the token of each sorted pair
    counts = torch.zeros(config.num_experts, dtype=torch.int32, device=h.device)
    counts.index_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
    offsets = counts.cumsum(0, dtype=torch.int32)  # [E] end of each expert's group
    expert_out = _expert_matmuls(h[token_idx], flat_ids[order], layer.experts_gate_up, layer.experts_down, offsets)
    expert_out = expert_out * weights.flatten()[order, None]  # [N*k, H]
    out = torch.zeros_like(h).index_add_(0, token_idx, expert_out)
    if config.num_shared_experts > 0:
        shared = swiglu(h, layer.gate_proj, layer.up_proj, layer.down_proj)
        out = out + shared if config.shared_expert_combination_strategy == "sum" else (out + shared) / 2
    return out


def mlp_branch(h: torch.Tensor, layer: LayerWeights, config: ModelConfig, layer_idx: int) -> torch.Tensor:
    if config.is_dense(layer_idx):
        return swiglu(h, layer.gate_proj, layer.up_proj, layer.down_proj)
    return batched_moe(h, layer, config)


def next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class TorchBackend:
    name = "torch"

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], num_pages: int, page_size: int,
                 max_batch: int, max_pages_per_seq: int, cuda_graphs: bool = True, compile: bool = False) -> None:
        check_weights(config, weights)
        self.config = config
        self.embed = weights["model.embed_tokens.weight"]  # [V, H]
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.final_norm, self.lm_head = weights["model.norm.weight"], weights["lm_head.weight"]
        self.layers: list[LayerWeights] = []
        self.qkv_proj: list[torch.Tensor] = []  # per layer [Hq*D + 2*Hkv*D, H]: one GEMM instead of three
        for i in range(config.num_hidden_layers):
            layer = layer_weights(config, weights, i)
            fused = torch.cat([layer.q_proj, layer.k_proj, layer.v_proj])
            q_rows, kv_rows = layer.q_proj.shape[0], layer.k_proj.shape[0]
            self.qkv_proj.append(fused)  # q/k/v_proj become its views, so the separate copies can be freed
            self.layers.append(dataclasses.replace(layer, q_proj=fused[:q_rows], k_proj=fused[q_rows:q_rows + kv_rows],
                                                   v_proj=fused[q_rows + kv_rows:]))
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta).to(self.device)  # [D/2] fp32
        self.page_size, self.max_batch, self.max_pages_per_seq = page_size, max_batch, max_pages_per_seq
        self.scratch_page = num_pages  # the pool's last page
        self.k_pool, self.v_pool = allocate_kv_pools(config, num_pages, page_size, self.dtype, self.device)
        # device block tables; row max_batch stays -1 for padded decode rows
        self.tables = torch.full((config.num_hidden_layers, max_batch + 1, max_pages_per_seq), -1,
                                 dtype=torch.int32, device=self.device)
        self.tables_version = -1
        self.use_graphs = cuda_graphs and self.device.type == "cuda"
        self.graphs: dict[tuple[int, int], _DecodeGraph] = {}
        self.graph_pool = None
        self.sampler = Sampler()
        # torch.compile fuses the small operations of the decode step (norms, RoPE, masks, routing); it
        # compiles once per (batch bucket, context bucket) before that shape's graph is captured
        self.decode_step = self._decode_logits
        if compile and self.device.type == "cuda":
            self.decode_step = torch.compile(self._decode_logits, dynamic=False, fullgraph=False)

    def can_sample(self, params: SamplingParams) -> bool:
        return True  # every parameter: the PyTorch sampler runs on this device after the step

    def _upload_tables(self, host_tables: torch.Tensor, version: int, high_water: int | None = None) -> None:
        """Copy the host block tables when they changed; only the first high_water columns were ever set."""
        if version != self.tables_version:
            columns = self.max_pages_per_seq if high_water is None else high_water
            self.tables[:, :self.max_batch, :columns].copy_(host_tables[:, :, :columns], non_blocking=True)
            self.tables_version = version

    # --- paged attention ---

    def _write_kv(self, layer_idx: int, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> None:
        """Scatter k, v: [N, Hkv, D] of rows [N] at positions [N] into their slots (scratch where unmapped)."""
        pages = self.tables[layer_idx, rows, positions // self.page_size].long()  # [N]
        pages = torch.where(pages < 0, self.scratch_page, pages)
        slots = pages * self.page_size + positions % self.page_size
        self.k_pool.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
        self.v_pool.view(-1, *v.shape[1:]).index_copy_(0, slots, v)

    def _visible_keys(self, layer_idx: int, rows: torch.Tensor, q_positions: torch.Tensor, first_page: torch.Tensor,
                      num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Which keys the queries see, for every layer of this layer's kind (they map pages alike).

        Rows [R], q_positions [R, T]; pages first_page[r] .. +num_pages-1 of row r. Returns page_idx
        [R, P] (clamped into the table) and visible [R, T, S = P*page_size]: causal, inside the window
        on sliding layers, mapped. Padded rows see one (scratch) key instead of none: no NaN."""
        window = self.config.window(layer_idx)
        page_idx = first_page[:, None] + torch.arange(num_pages, device=rows.device)  # [R, P]
        in_table = page_idx < self.max_pages_per_seq
        page_idx = page_idx.clamp(max=self.max_pages_per_seq - 1)
        mapped = (self.tables[layer_idx, rows[:, None], page_idx] >= 0) & in_table
        k_positions = (page_idx[:, :, None] * self.page_size
                       + torch.arange(self.page_size, device=rows.device)).flatten(1)  # [R, S]
        distance = q_positions[:, :, None] - k_positions[:, None, :]  # [R, T, S]
        visible = (distance >= 0) & mapped.repeat_interleave(self.page_size, dim=1)[:, None, :]
        if window is not None:
            visible &= distance < window
        visible[..., -1] |= ~visible.any(dim=-1)
        return page_idx, visible

    def _attend(self, layer_idx: int, q: torch.Tensor, rows: torch.Tensor, page_idx: torch.Tensor,
                visible: torch.Tensor) -> torch.Tensor:
        """q: [R, T, Hq, D] -> [R, T, Hq*D], reading pages page_idx [R, P] of each row's table in this
        layer, with the mask of _visible_keys. Scores in the model dtype times head_dim**-0.5, softmax
        in fp32, as model.attention."""
        pages = self.tables[layer_idx, rows[:, None], page_idx].long()
        pages = torch.where(pages < 0, self.scratch_page, pages)
        keys = self.k_pool[pages].flatten(1, 2)  # [R, S, Hkv, D]
        values = self.v_pool[pages].flatten(1, 2)
        r, t, num_heads, head_dim = q.shape
        num_kv_heads = keys.shape[2]
        q = q.view(r, t, num_kv_heads, num_heads // num_kv_heads, head_dim)  # q head j reads KV head j // group
        block = max(1, SCORE_BUDGET_BYTES // (r * num_heads * keys.shape[1] * 4))  # queries per score block
        out = [self._attend_block(q[:, i:i + block], keys, values, visible[:, i:i + block]) for i in range(0, t, block)]
        return (out[0] if len(out) == 1 else torch.cat(out, dim=1)).reshape(r, t, num_heads * head_dim)

    @staticmethod
    def _attend_block(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """q: [R, T, Hkv, G, D], keys/values [R, S, Hkv, D], visible [R, T, S] -> [R, T, Hkv, G, D]."""
        scores = torch.einsum("rthgd,rshd->rhgts", q, keys) * q.shape[-1] ** -0.5  # [R, Hkv, G, T, S]
        scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.einsum("rhgts,rshd->rthgd", probs, values)

    def _window_pages(self) -> int:
        """Pages that hold a window of W positions ending anywhere (it need not start on a page)."""
        return -(-self.config.sliding_window // self.page_size) + 1

    # --- forward ---

    def _forward(self, token_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                 num_full_pages: int, sliding_first_page: torch.Tensor | None, sliding_pages: int) -> torch.Tensor:
        """token_ids, positions: [R, T] of rows [R] -> hidden [R, T, H]. Prefill passes one row's chunk
        (R = 1), decode one token per row (T = 1). Full layers read pages 0..num_full_pages-1, sliding
        layers sliding_pages pages from sliding_first_page [R] (None: from the last query's window)."""
        cfg = self.config
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.dtype)  # [R, T, D]
        if sliding_first_page is None and cfg.sliding_window is not None:
            sliding_first_page = (positions[:, 0] - cfg.sliding_window + 1).clamp(min=0) // self.page_size
        views = {}  # layer kind (sliding?) -> (page_idx, visible), computed at its first layer
        x = F.embedding(token_ids, self.embed)  # [R, T, H]
        for i, layer in enumerate(self.layers):
            sliding = cfg.window(i) is not None
            if sliding not in views:
                first, count = (sliding_first_page, sliding_pages) if sliding else (torch.zeros_like(rows), num_full_pages)
                views[sliding] = self._visible_keys(i, rows, positions, first, count)
            x = self.layer_forward(i, x, rows, positions, cos, sin, *views[sliding])
        return x

    def layer_forward(self, layer_idx: int, x: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, page_idx: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """One parallel block: x [R, T, H] -> x + attention + MLP, writing this layer's K/V into the pool."""
        cfg, layer = self.config, self.layers[layer_idx]
        h = norm(x, layer.input_norm, cfg)
        num_heads, num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        qkv = F.linear(h, self.qkv_proj[layer_idx]).unflatten(-1, (-1, cfg.head_dim))  # [R, T, Hq + 2*Hkv, D]
        if cfg.uses_rope(layer_idx):  # q and k heads rotated together
            qk = apply_rope(qkv[..., :num_heads + num_kv_heads, :], cos, sin)
            q, k = qk[..., :num_heads, :], qk[..., num_heads:, :]
        else:
            q, k = qkv[..., :num_heads, :], qkv[..., num_heads:num_heads + num_kv_heads, :]
        v = qkv[..., num_heads + num_kv_heads:, :]
        flat_rows = rows[:, None].expand(positions.shape).flatten()
        self._write_kv(layer_idx, flat_rows, positions.flatten(), k.flatten(0, 1), v.flatten(0, 1))
        attn = self._attend(layer_idx, q, rows, page_idx, visible)
        mlp_out = mlp_branch(h.flatten(0, 1), layer, cfg, layer_idx).view_as(h)
        return x + F.linear(attn, layer.o_proj) + mlp_out

    @torch.inference_mode()
    def prefill(self, batch: PrefillBatch) -> torch.Tensor:
        """Each chunk runs alone: its tokens attend to each other and to the row's cached pages."""
        self._upload_tables(batch.block_tables, batch.tables_version, batch.tables_columns)
        last_hidden = []
        for chunk in batch.chunks:
            end = chunk.start + len(chunk.token_ids)
            positions = torch.arange(chunk.start, end, device=self.device)[None]  # [1, T]
            rows = torch.tensor([chunk.row], device=self.device)
            token_ids = torch.tensor(chunk.token_ids, device=self.device)[None]
            end_page = -(-end // self.page_size)
            first = 0
            if self.config.sliding_window is not None:  # the window of the chunk's first query
                first = max(0, chunk.start - self.config.sliding_window + 1) // self.page_size
            x = self._forward(token_ids, positions, rows, end_page,
                              torch.tensor([first], device=self.device), end_page - first)
            last_hidden.append(x[0, -1])
        return lm_logits(torch.stack(last_hidden), self.final_norm, self.lm_head, self.config).float()

    def _decode_logits(self, token_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                       num_full_pages: int) -> torch.Tensor:
        """[B] -> logits [B, V] fp32; static shapes for a given (B, num_full_pages)."""
        x = self._forward(token_ids[:, None], positions[:, None], rows, num_full_pages, None,
                          self._window_pages() if self.config.sliding_window is not None else 0)
        return lm_logits(x[:, 0], self.final_norm, self.lm_head, self.config).float()

    @torch.inference_mode()
    def decode(self, batch: DecodeBatch) -> DecodeResult:
        logits = self._decode_logits_for(batch)
        token_ids = self.sampler.sample(logits, batch.sampling).token_ids if batch.sample else None
        return DecodeResult(token_ids, logits if batch.return_logits else None)

    def _decode_logits_for(self, batch: DecodeBatch) -> torch.Tensor:
        """[B, V] fp32 logits of one decode step (in a CUDA graph on a GPU)."""
        self._upload_tables(batch.block_tables, batch.tables_version, batch.tables_columns)
        num_rows = len(batch.rows)
        bucket = min(next_power_of_two(num_rows), self.max_batch) if self.use_graphs else num_rows
        context_pages = -(-(max(batch.positions) + 1) // self.page_size)
        num_full_pages = context_pages  # eager: exactly the pages needed; graphs: a bucket of them
        if self.use_graphs:
            num_full_pages = min(max(MIN_CONTEXT_PAGES, next_power_of_two(context_pages)), self.max_pages_per_seq)
        pad = bucket - num_rows
        token_ids = torch.tensor(batch.token_ids + [0] * pad)
        positions = torch.tensor(batch.positions + [0] * pad)
        rows = torch.tensor(batch.rows + [self.max_batch] * pad)
        if not self.use_graphs:
            logits = self.decode_step(token_ids.to(self.device), positions.to(self.device),
                                      rows.to(self.device), num_full_pages)
            return logits[:num_rows]
        graph = self.graphs.get((bucket, num_full_pages))
        if graph is None:
            graph = self._capture(bucket, num_full_pages)
        return graph.run(token_ids, positions, rows)[:num_rows].clone()

    def warm_up(self) -> None:
        """Capture the decode graph of every batch bucket at the smallest context before serving, so the
        first requests do not pay for it (longer contexts capture their bucket on first use)."""
        if not self.use_graphs:
            return
        pages = min(MIN_CONTEXT_PAGES, self.max_pages_per_seq)
        for bucket in sorted({min(next_power_of_two(n), self.max_batch) for n in range(1, self.max_batch + 1)}):
            if (bucket, pages) not in self.graphs:
                self._capture(bucket, pages)

    def _capture(self, bucket: int, num_full_pages: int) -> _DecodeGraph:
        log.info("capturing the decode graph for batch %d, %d context pages", bucket, num_full_pages)
        graph = _DecodeGraph(self, bucket, num_full_pages)
        self.graphs[(bucket, num_full_pages)] = graph
        return graph


class _DecodeGraph:
    """One captured decode step over static input buffers; `run` copies inputs in and replays."""

    def __init__(self, backend: TorchBackend, batch: int, num_full_pages: int) -> None:
        device = backend.device
        self.token_ids = torch.zeros(batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        self.rows = torch.full((batch,), backend.max_batch, dtype=torch.long, device=device)
        step = lambda: backend.decode_step(self.token_ids, self.positions, self.rows, num_full_pages)  # noqa: E731
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph (allocator, lazy kernels)
                step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=backend.graph_pool):
            self.logits = step()
        backend.graph_pool = self.graph.pool()

    def run(self, token_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        self.token_ids.copy_(token_ids, non_blocking=True)
        self.positions.copy_(positions, non_blocking=True)
        self.rows.copy_(rows, non_blocking=True)
        self.graph.replay()
        return self.logits
