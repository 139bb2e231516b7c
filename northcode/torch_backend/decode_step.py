"""The torch decode step: one token per row through all layers on the paged KV cache, in few kernels.

A decode step of a small batch is bound by its kernel count as much as by its bytes (a CUDA-graph node
costs about 0.5 us plus a tail; shared/docs/perf_anchors.md), so this step is organised to launch as
few kernels as stock PyTorch ops allow, with static shapes for a (batch, context bucket) pair, no host
sync and no Python loop over rows or experts: it is captured whole in a CUDA graph (backend.py).
`python -m northcode.torch_backend.op_count` counts its kernels on the CPU (North Mini Code's layer plan:
1050 at batch 1, 1279 at batch 8; the step this replaced took 2825 and 2972).

Once per step (`prepare`, 37 small kernels whatever the depth):
  - RoPE as matrices: I*cos + S*sin (S swaps each pair with a sign) per row for the query and key
    slots, I for the value slot, [B*(G+2), D, D], so one bmm rotates a layer's q and k and passes v
    through; the entries are the model-dtype cos/sin, so the products are model.py's;
  - the slot of each row's new token in every layer: write_slots [L, B];
  - per layer kind (full, sliding), for all layers of that kind at once: the pages to read,
    pages [L_kind, B, P] (from backend.page_of: the block tables with the scratch page for -1), and
    the additive mask bias [B, 1, 1, S] (0 where a key is visible: causal, inside the window on
    sliding layers; -inf elsewhere). Full layers read the context bucket's P pages, sliding layers
    the window's (at most ceil(W/page)+1).
Per layer (at B = 1: 10 kernels of attention, 11 of routed MoE, 4 of dense MLP):
  norm (one fused rms_norm / layer_norm); QKV and the router logits in one GEMM (the fused weight holds
  the slot-major QKV rows, then the router's on sparse layers); RoPE (one bmm); the K and V writes (one
  index_put_: the pools are the two halves of one tensor); one gather of the layer's K and V pages (in
  8-byte words: a quarter of the elements in bf16);
  scores (bmm), mask (one add that also applies the score scale), softmax, probs @ V (bmm); o_proj
  added into the residual in place (addmm_); then the MLP, added in place too (routed_experts.py:
  top-k, sort, two grouped GEMMs, combine; or the dense SwiGLU on its fused gate_up weight).
The fused QKV weight is slot-major (slot_major_qkv): its output [B, G+2, Hkv, D] holds the G query
slots, then K, then V, so K and V of a row are adjacent (one write) and at B = 1 the queries of each KV
head are a strided batch the scores bmm takes as is (B > 1 copies them, and the QKV part of the GEMM
output before RoPE: two more kernels a layer).
Results equal model.py's to fp32 rounding (fp32); in bf16 a few roundings move (the score scale is
applied with the mask, the residual adds happen inside the GEMMs, experts are summed in one bmm).
Padded batch rows (row index max_batch, position 0) read and write only the scratch page.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from northcode.model.model import rope_cos_sin
from northcode.torch_backend.routed_experts import add_moe


@dataclass(slots=True)
class LayerKindView:
    """What every layer of one kind (full or sliding attention) reads in this step."""

    pages: torch.Tensor  # long [L_kind, B, P]: physical page of each layer, row, logical page (scratch if none)
    bias: torch.Tensor  # model dtype [B, 1, 1, P*page_size]: 0 where the key is visible, -inf elsewhere


@dataclass(slots=True)
class StepTensors:
    rope: torch.Tensor | None  # [B*(G+2), D, D] model dtype: per row and head slot, x @ rope rotates x's
    # pairs (query and key slots) or leaves x alone (the value slot); None: no RoPE layer
    write_slots: torch.Tensor  # long [L, B]: pool slot of each row's new token in each layer
    kinds: dict[bool, LayerKindView]  # sliding? -> view


def rope_basis(head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """eye, swap [D, D] with x @ (eye*cos + swap*sin) = model.apply_rope(x): (x0, x1) -> (x0 c - x1 s, x1 c + x0 s)."""
    eye = torch.eye(head_dim, dtype=dtype, device=device)
    swap = torch.zeros(head_dim, head_dim, dtype=dtype, device=device)
    pairs = torch.arange(0, head_dim, 2, device=device)
    swap[pairs + 1, pairs] = -1.0  # out[2i] gets -x[2i+1] s
    swap[pairs, pairs + 1] = 1.0  # out[2i+1] gets x[2i] s
    return eye, swap


def slot_major_qkv(q_proj: torch.Tensor, k_proj: torch.Tensor, v_proj: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """The fused QKV weight [(G+2)*Hkv*D, H] in slot-major order: its output viewed [G+2, Hkv, D] holds
    query head h*G + g at [g, h], key head h at [G, h] and value head h at [G+1, h]."""
    hidden = q_proj.shape[1]
    head_dim = k_proj.shape[0] // num_kv_heads
    q = q_proj.view(num_kv_heads, -1, head_dim, hidden).transpose(0, 1).flatten(0, 2)  # [G*Hkv*D, H], g-major
    return torch.cat([q, k_proj, v_proj])


class DecodeStep:
    """Decode step over a TorchBackend's weights, pools and device block tables (read at each call)."""

    def __init__(self, backend) -> None:
        cfg = self.config = backend.config
        self.backend = backend
        self.page_size = backend.page_size
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.group = self.num_heads // self.num_kv_heads
        device, dtype = backend.device, backend.dtype
        self.rope_eye, self.rope_swap = rope_basis(cfg.head_dim, dtype, device)
        self.head_range = torch.arange(self.num_kv_heads, device=device)[None, :, None]  # [1, Hkv, 1]
        self.is_value_slot = (torch.arange(self.group + 2, device=device) == self.group + 1)[None, :, None, None]
        self.k_and_v = torch.arange(2, device=device)[None, :]  # [1, 2]: the pool halves
        self.page_offsets = torch.arange(self.page_size, device=device)  # [ps]
        self.page_range = torch.arange(backend.max_pages_per_seq, device=device)  # [max pages], sliced per step
        self.expert_range = torch.arange(cfg.num_experts, device=device)
        self.kind_layers: dict[bool, torch.Tensor] = {}  # sliding? -> long [L_kind] layer ids
        self.position_in_kind: list[int] = []  # layer -> its index among the layers of its kind
        for i in range(cfg.num_hidden_layers):
            sliding = cfg.window(i) is not None
            members = [j for j in range(i) if (cfg.window(j) is not None) == sliding]
            self.position_in_kind.append(len(members))
        for sliding in (False, True):
            ids = [i for i in range(cfg.num_hidden_layers) if (cfg.window(i) is not None) == sliding]
            if ids:
                self.kind_layers[sliding] = torch.tensor(ids, device=device)
        pool = backend.kv_pool  # [2, num_pages + 1, ps, Hkv, D]
        self.pool_slots = pool.view(2, -1, self.num_kv_heads, self.head_dim)  # [K or V, slots, Hkv, D]
        # [2, Hkv, pages, ps, D / r]: gathers come out head-major, and move r elements of the model dtype as
        # one 8-byte word (r = 4 in bf16), so the index kernel handles r times fewer elements for the same bytes
        self.pool_dtype = pool.dtype
        self.gather_dtype = torch.int64 if self.head_dim * pool.element_size() % 8 == 0 else pool.dtype
        self.pool_by_head = pool.permute(0, 3, 1, 2, 4).view(self.gather_dtype)

    def window_pages(self) -> int:
        """Pages that hold a window of W positions ending anywhere (it need not start on a page)."""
        return -(-self.config.sliding_window // self.page_size) + 1

    # --- once per step ---

    def prepare(self, positions: torch.Tensor, rows: torch.Tensor, num_full_pages: int) -> StepTensors:
        """positions, rows: long [B] -> what the layers share. Full layers read pages 0..num_full_pages-1."""
        cfg, backend, ps = self.config, self.backend, self.page_size
        rope = None
        if any(cfg.uses_rope(i) for i in range(cfg.num_hidden_layers)):
            cos, sin = rope_cos_sin(positions, backend.inv_freq, backend.dtype)  # [B, D] each
            rotation = torch.addcmul(self.rope_eye * cos[:, None, :], self.rope_swap, sin[:, None, :])  # [B, D, D]
            rope = torch.where(self.is_value_slot, self.rope_eye, rotation[:, None]).flatten(0, 1)  # [B*(G+2), D, D]
        write_slots = backend.page_of[:, rows, positions // ps] * ps + positions % ps  # [L, B]
        kinds = {}
        for sliding, layer_ids in self.kind_layers.items():
            window = cfg.sliding_window if sliding else None
            count = min(self.window_pages(), num_full_pages) if sliding else num_full_pages
            kinds[sliding] = self._kind_view(layer_ids, rows, positions, count, window)
        return StepTensors(rope, write_slots, kinds)

    def _kind_view(self, layer_ids: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, num_pages: int,
                   window: int | None) -> LayerKindView:
        """Pages 0..num_pages-1 (full layers) or from the page of each row's window start (sliding ones).

        Only the position decides what a query sees: keys at p-W+1..p (all <= p on full layers). The
        pages holding them are always mapped (full layers keep every page, sliding layers every page of
        the window), so nothing unmapped is ever visible, and every row sees at least its own key (a
        padded row at position 0 sees key 0 of the scratch page, finite): no NaN."""
        backend, ps, max_pages = self.backend, self.page_size, self.backend.max_pages_per_seq
        page_idx = self.page_range[:num_pages].expand(rows.shape[0], -1)  # [B, P] logical pages
        if window is not None:  # from the page of the window's first position; clamped at the table's end
            page_idx = ((positions - window + 1).clamp(min=0) // ps)[:, None] + page_idx
            beyond = page_idx >= max_pages
            page_idx = page_idx.clamp(max=max_pages - 1)
        pages = backend.page_of[layer_ids[:, None, None], rows[None, :, None], page_idx[None]]  # [L_kind, B, P]
        distance = positions[:, None, None] - (page_idx[:, :, None] * ps + self.page_offsets)  # [B, P, ps]
        hidden = distance < 0
        if window is not None:
            hidden |= (distance >= window) | beyond[:, :, None]  # a clamped page repeats the last one: hide it
        bias = torch.zeros(hidden.shape, dtype=backend.dtype, device=rows.device).masked_fill_(hidden, float("-inf"))
        return LayerKindView(pages, bias.view(rows.shape[0], 1, 1, -1))

    # --- per layer ---

    def layer(self, layer_idx: int, x: torch.Tensor, step: StepTensors) -> torch.Tensor:
        """x [B, H] (the residual stream, updated in place and returned) += attention + MLP of layer_idx."""
        cfg, backend = self.config, self.backend
        layer = backend.layers[layer_idx]
        h = backend.norm(x, layer.input_norm)  # [B, H]
        qkv_router = F.linear(h, backend.qkv_proj[layer_idx])  # [B, QKV (+ E router logits on sparse layers)]
        self._add_attention(layer_idx, x, qkv_router[:, :backend.qkv_size], step)
        if cfg.is_dense(layer_idx):
            gate, up = F.linear(h, backend.dense_gate_up[layer_idx]).chunk(2, dim=-1)  # [B, I] each
            return x.addmm_(F.silu(gate) * up, layer.down_proj.t())
        return add_moe(x, h, layer, cfg, backend.moe_path, self.expert_range, qkv_router[:, backend.qkv_size:])

    def _add_attention(self, layer_idx: int, x: torch.Tensor, qkv: torch.Tensor, step: StepTensors) -> None:
        """x [B, H] += o_proj(attention) for qkv [B, (G+2)*Hkv*D] (slot-major, a view of a wider GEMM output)."""
        cfg, backend = self.config, self.backend
        batch, kv_heads, group, head_dim = x.shape[0], self.num_kv_heads, self.group, self.head_dim
        if cfg.uses_rope(layer_idx):  # one bmm rotates queries and keys, leaves values (B > 1: a copy first)
            qkv = torch.bmm(qkv.reshape(batch * (group + 2), kv_heads, head_dim), step.rope)
        qkv = qkv.view(batch, group + 2, kv_heads, head_dim)  # [B, slot, Hkv, D]
        self.pool_slots.index_put_((self.k_and_v, step.write_slots[layer_idx][:, None]), qkv[:, group:])
        kind = step.kinds[cfg.window(layer_idx) is not None]
        pages = kind.pages[self.position_in_kind[layer_idx]]  # [B, P]
        kv = self.pool_by_head[:, self.head_range, pages[:, None, :]].view(self.pool_dtype)  # [2, B, Hkv, P, ps, D]
        keys = kv[0].reshape(batch * kv_heads, -1, head_dim)  # [B*Hkv, S, D]
        values = kv[1].reshape(batch * kv_heads, -1, head_dim)
        queries = qkv[:, :group].transpose(1, 2).reshape(batch * kv_heads, group, head_dim)  # a view when B = 1
        scores = torch.bmm(queries, keys.transpose(1, 2))  # [B*Hkv, G, S] in the model dtype
        scores = torch.add(kind.bias, scores.view(batch, kv_heads, group, -1), alpha=head_dim ** -0.5)
        probs = torch.softmax(scores, dim=-1)  # fp32 inside the kernel, as model.attention
        attn = torch.bmm(probs.view(batch * kv_heads, group, -1), values)  # [B*Hkv, G, D] = [B, Hq, D]
        x.addmm_(attn.view(batch, -1), backend.layers[layer_idx].o_proj.t())

    # --- the whole step ---

    def __call__(self, token_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                 num_full_pages: int, residuals: list | None = None) -> torch.Tensor:
        """token_ids, positions, rows: long [B] -> fp32 logits [B, V]; K/V of the new tokens written.
        residuals: a list to append the residual stream [B, H] to, the embedding and then after each layer
        (tests trace where two paths part; never inside a CUDA graph)."""
        backend = self.backend
        with torch.profiler.record_function("step.prepare"):
            step = self.prepare(positions, rows, num_full_pages)
            x = F.embedding(token_ids, backend.embed)  # [B, H], a fresh tensor: the layers add into it
        for i in range(self.config.num_hidden_layers):
            if residuals is not None:
                residuals.append(x.clone())
            with torch.profiler.record_function(f"layer.{layer_kind(self.config, i)}"):
                x = self.layer(i, x, step)
        if residuals is not None:
            residuals.append(x.clone())
        with torch.profiler.record_function("step.lm_head"):
            return backend.logits(x)


def layer_kind(config, layer_idx: int) -> str:
    """A layer's kind: attention (full/sliding), RoPE or not, MLP (dense/moe); names profiler ranges."""
    attention = "sliding" if config.window(layer_idx) is not None else "full"
    rope = "rope" if config.uses_rope(layer_idx) else "nope"
    mlp = "dense" if config.is_dense(layer_idx) else "moe"
    return f"{attention}_{rope}_{mlp}"
