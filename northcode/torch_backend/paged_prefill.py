"""Chunked prefill on the paged KV cache: one row's chunk of T tokens through all layers (TorchBackend).

The chunk's K/V are scattered into their slots first; then its queries attend to the row's pages (full
layers all pages up to the chunk's end, sliding layers from the window of the chunk's first query),
masked by position: causal, inside the window on sliding layers, mapped. Attention is
scaled_dot_product_attention with that mask (a fused kernel on the GPU), in query blocks where its math path
(the CPU) would write fp32 scores beyond SCORE_BUDGET_BYTES (long prompts stay in memory).
It runs eagerly (shapes change with every chunk); the decode step (decode_step.py) is the graphed path.
The fused QKV weight is in decode_step.slot_major_qkv's order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from northcode.engine.device import to_device
from northcode.model.model import apply_rope, rope_cos_sin, swiglu
from northcode.torch_backend.routed_experts import add_moe

SCORE_BUDGET_BYTES = 1 << 30  # fp32 attention scores of one query block at most
# not cuDNN's attention, which SDPA prefers for a masked bf16 case on sm_90 but which builds a plan for every new
# (chunk, keys) shape: a warm turn (+32 tokens on 4096 cached) took 120 ms with it against 49 before; CUTLASS's
# memory-efficient kernel has no per-shape set-up; the CPU takes flash (with a mask) or math
PREFILL_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
# chunks of at least this many tokens attend on full layers causal from the bottom right, without a mask (16K cold
# 1471 -> 1259 ms, 4K 233 -> 222, at chunks of 2048); shorter ones keep the mask: warm turns (32-57 tokens) took
# 90-102 ms causal against 50-59 with the mask, a cost not yet explained
CAUSAL_MIN_QUERIES = 1024


class ChunkPrefill:
    def __init__(self, backend) -> None:
        self.backend, self.config = backend, backend.config
        self.expert_range = torch.arange(self.config.num_experts, device=backend.device)

    def forward(self, token_ids: torch.Tensor, start: int, row: int) -> torch.Tensor:
        """token_ids [T] at positions start.. of block-table row `row` -> hidden states [T, H]."""
        backend, cfg, ps = self.backend, self.config, self.backend.page_size
        end = start + token_ids.shape[0]
        positions = torch.arange(start, end, device=backend.device)[None]  # [1, T]
        rows = to_device(torch.tensor([row]), backend.device)  # [1], enqueued without a host wait
        cos, sin = rope_cos_sin(positions, backend.inv_freq, backend.dtype)  # [1, T, D]
        end_page = -(-end // ps)
        first = max(0, start - cfg.sliding_window + 1) // ps if cfg.sliding_window is not None else 0
        views = {}  # sliding? -> (page_idx, visible or None), computed at the first layer of the kind
        x = F.embedding(token_ids[None], backend.embed)  # [1, T, H]
        for i in range(cfg.num_hidden_layers):
            sliding = cfg.window(i) is not None
            if sliding not in views:  # full layers map every page before the chunk's end: causal alone, no mask
                causal = not sliding and token_ids.shape[0] >= CAUSAL_MIN_QUERIES
                views[sliding] = ((torch.arange(end_page, device=backend.device)[None], None) if causal else
                                  self.visible_keys(i, rows, positions, first if sliding else 0,
                                                    end_page - first if sliding else end_page))
            x = self.layer(i, x, rows, positions, cos, sin, *views[sliding], end)
        return x[0]

    def visible_keys(self, layer_idx: int, rows: torch.Tensor, q_positions: torch.Tensor, first_page: int,
                     num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Which keys the queries see, for every layer of this layer's kind (they map pages alike).

        Rows [R], q_positions [R, T]; pages first_page .. +num_pages-1. Returns page_idx [R, P] and
        visible [R, T, S = P*page_size]: causal, inside the window on sliding layers, mapped."""
        backend, ps = self.backend, self.backend.page_size
        window = self.config.window(layer_idx)
        page_idx = (first_page + torch.arange(num_pages, device=rows.device))[None].expand(rows.shape[0], -1)
        mapped = backend.tables[layer_idx, rows[:, None], page_idx] >= 0
        k_positions = (page_idx[:, :, None] * ps + torch.arange(ps, device=rows.device)).flatten(1)  # [R, S]
        distance = q_positions[:, :, None] - k_positions[:, None, :]  # [R, T, S]
        visible = (distance >= 0) & mapped.repeat_interleave(ps, dim=1)[:, None, :]
        if window is not None:
            visible &= distance < window
        return page_idx, visible

    def layer(self, layer_idx: int, x: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor, page_idx: torch.Tensor, visible: torch.Tensor | None,
              end: int) -> torch.Tensor:
        """One parallel block: x [R, T, H] -> x + attention + MLP, writing this layer's K/V into the pool.
        visible: visible_keys' mask, or None on a full layer (every key before position `end`, causal)."""
        backend, cfg = self.backend, self.config
        layer = backend.layers[layer_idx]
        kv_heads, group = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
        h = backend.norm(x, layer.input_norm)
        qkv_router = F.linear(h, backend.qkv_proj[layer_idx])  # [R, T, QKV (+ E router logits)]
        qkv = qkv_router[..., :backend.qkv_size].unflatten(-1, (group + 2, kv_heads, cfg.head_dim))
        qk = qkv[..., :group + 1, :, :].flatten(-3, -2)  # [R, T, (G+1)*Hkv, D]: query slots, then keys
        if cfg.uses_rope(layer_idx):  # q and k heads rotated together
            qk = apply_rope(qk, cos, sin)
        qk = qk.unflatten(-2, (group + 1, kv_heads))  # [R, T, G+1, Hkv, D]
        q = qk[..., :group, :, :].transpose(-3, -2).flatten(-3, -2)  # [R, T, Hq, D], head h*G + g
        k, v = qk[..., group, :, :], qkv[..., group + 1, :, :]  # [R, T, Hkv, D]
        flat_rows = rows[:, None].expand(positions.shape).flatten()
        self.write_kv(layer_idx, flat_rows, positions.flatten(), k.flatten(0, 1), v.flatten(0, 1))
        attn = self.attend(layer_idx, q, rows, page_idx, visible, end)
        x = x + F.linear(attn, layer.o_proj)
        h_flat, x_flat = h.flatten(0, 1), x.view(-1, x.shape[-1])
        if cfg.is_dense(layer_idx):
            x_flat.add_(swiglu(h_flat, layer.gate_proj, layer.up_proj, layer.down_proj))
        else:
            add_moe(x_flat, h_flat, layer, cfg, backend.prefill_moe_path, self.expert_range,
                    qkv_router[..., backend.qkv_size:].flatten(0, 1))
        return x

    def write_kv(self, layer_idx: int, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        """Scatter k, v: [N, Hkv, D] of rows [N] at positions [N] into their slots (scratch where unmapped)."""
        backend, ps = self.backend, self.backend.page_size
        pages = backend.tables[layer_idx, rows, positions // ps].long()  # [N]
        slots = torch.where(pages < 0, backend.scratch_page, pages) * ps + positions % ps
        backend.k_pool.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
        backend.v_pool.view(-1, *v.shape[1:]).index_copy_(0, slots, v)

    def attend(self, layer_idx: int, q: torch.Tensor, rows: torch.Tensor, page_idx: torch.Tensor,
               visible: torch.Tensor | None, end: int) -> torch.Tensor:
        """q: [R, T, Hq, D] at positions end - T .. end - 1 -> [R, T, Hq*D], reading pages page_idx [R, P] of
        each row's table in this layer, with visible_keys' mask, or (visible None: a full layer) the keys of
        positions 0 .. end - 1, causal from the bottom right (no mask: the kernel skips the blocks above it).
        scaled_dot_product_attention: on the GPU a fused kernel (PREFILL_SDPA_BACKENDS: scores and softmax in
        fp32 on chip, none written out; written-out scores, their softmax and copies were ~40% of a prefill),
        so it rounds less than model.attention's bf16 scores; on the CPU in query blocks whose fp32
        scores stay under SCORE_BUDGET_BYTES."""
        backend = self.backend
        pages = backend.tables[layer_idx, rows[:, None], page_idx].long()
        pages = torch.where(pages < 0, backend.scratch_page, pages)
        r, t, num_heads, head_dim = q.shape
        group = num_heads // backend.k_pool.shape[2]  # q head j reads KV head j // group
        keys = backend.k_pool[pages].flatten(1, 2).transpose(1, 2).repeat_interleave(group, dim=1)  # [R, Hq, S, D]
        values = backend.v_pool[pages].flatten(1, 2).transpose(1, 2).repeat_interleave(group, dim=1)
        q = q.transpose(1, 2)  # [R, Hq, T, D]
        block = max(1, SCORE_BUDGET_BYTES // (r * num_heads * keys.shape[2] * 4))  # queries per score block
        out = []
        with sdpa_kernel(PREFILL_SDPA_BACKENDS):
            for i in range(0, t, block):
                j = min(i + block, t)
                if visible is None:  # queries i..j-1 see keys 0 .. end - t + j - 1: the block's bottom-right corner
                    seen = end - t + j
                    out.append(F.scaled_dot_product_attention(q[:, :, i:j], keys[:, :, :seen], values[:, :, :seen],
                                                              attn_mask=causal_lower_right(j - i, seen)))
                else:
                    out.append(F.scaled_dot_product_attention(q[:, :, i:j], keys, values,
                                                              attn_mask=visible[:, None, i:j]))
        out = out[0] if len(out) == 1 else torch.cat(out, dim=2)  # [R, Hq, T, D]
        return out.transpose(1, 2).reshape(r, t, num_heads * head_dim)
