"""The reference PyTorch model of cohere2_moe (North Mini Code): the oracle for the paged engine
and the megakernel.

It follows transformers' `modeling_cohere2_moe.py` op for op, casting where it casts, so that fp32
logits agree to rounding and bf16 runs take the same roundings. The building blocks (norm, rope,
qkv projection, attention, router, experts, dense MLP, LM head) are module-level functions on plain
tensors that the paged torch backend reuses; `NorthModel` strings them together over a contiguous
KV cache (`KVCache`). It does not page, batch sequences of different lengths, sample or tokenize.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from northcode.config import ModelConfig
from northcode.model.checkpoint import ProgressCallback, canonical_shapes, load_checkpoint

# --- building blocks (shared with torch_backend/backend.py) ---


def norm(x: torch.Tensor, weight: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """RMSNorm (rms_norm_eps set) or mean-centred LayerNorm without bias (rms_norm_eps absent).

    x: [..., H] in the model dtype -> [..., H] same dtype. Both compute in fp32; RMSNorm casts back
    to x's dtype before the weight multiply, LayerNorm multiplies in fp32 and casts after (as transformers).
    """
    x32 = x.float()
    if config.uses_rms_norm:
        variance = x32.pow(2).mean(-1, keepdim=True)
        return weight * (x32 * torch.rsqrt(variance + config.norm_eps)).to(x.dtype)
    mean = x32.mean(-1, keepdim=True)
    variance = (x32 - mean).pow(2).mean(-1, keepdim=True)
    normed = (x32 - mean) * torch.rsqrt(variance + config.norm_eps)
    return (weight.float() * normed).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """[head_dim/2] fp32 inverse frequencies, computed on the CPU as transformers does at init."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [..., D] for positions [...] (int). GPT-J layout: frequency i fills dims 2i and 2i+1.

    Angles are fp32 (position * inv_freq); the result is cast to the model dtype, as transformers does.
    """
    angles = positions[..., None].float() * inv_freq.to(device=positions.device)  # [..., D/2]
    angles = torch.repeat_interleave(angles, 2, dim=-1)  # [..., D]: interleaved pairs, not Llama's halves
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (2i, 2i+1) of x: [..., T, heads, D] by cos, sin: [..., T, D]; computed in fp32."""
    x32 = x.float()
    rotated = torch.stack([-x32[..., 1::2], x32[..., ::2]], dim=-1).flatten(-2)  # (x0,x1) -> (-x1,x0)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    return (x32 * cos + rotated * sin).to(x.dtype)


def project_qkv(h: torch.Tensor, layer: LayerWeights, config: ModelConfig) -> tuple[torch.Tensor, ...]:
    """h: [..., H] normed input -> q [..., Hq, D], k [..., Hkv, D], v [..., Hkv, D] (before RoPE)."""
    head_dim = config.head_dim
    q = F.linear(h, layer.q_proj).unflatten(-1, (-1, head_dim))
    k = F.linear(h, layer.k_proj).unflatten(-1, (-1, head_dim))
    v = F.linear(h, layer.v_proj).unflatten(-1, (-1, head_dim))
    return q, k, v


def attention_mask(q_positions: torch.Tensor, k_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """bool [T, S]: query at position p sees keys at p-window+1 .. p (all keys <= p when window is None)."""
    distance = q_positions[:, None] - k_positions[None, :]  # [T, S], >= 0 for past keys
    visible = distance >= 0
    if window is not None:
        visible &= distance < window
    return visible


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
              k_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal GQA attention over a contiguous cache, eager and in the order transformers uses.

    q: [B, T, Hq, D]; k, v: [B, S, Hkv, D] (K after RoPE); positions: [T], [S] -> [B, T, Hq*D].
    Scores are q.k in the model dtype times head_dim**-0.5, softmax in fp32, cast back before @ v.
    Every query must see at least one key (its own position is in k_positions).
    """
    group = q.shape[2] // k.shape[2]  # query heads per KV head; q head j reads KV head j // group
    q = q.transpose(1, 2)  # [B, Hq, T, D]
    k = k.transpose(1, 2).repeat_interleave(group, dim=1)  # [B, Hq, S, D]
    v = v.transpose(1, 2).repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5  # [B, Hq, T, S]
    visible = attention_mask(q_positions, k_positions, window)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v)  # [B, Hq, T, D]
    return out.transpose(1, 2).flatten(2)


def route(h: torch.Tensor, router: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """h: [N, H], router: [E, H] -> (weights [N, k] in h's dtype, expert ids [N, k] int64).

    Top-k of the router logits, then softmax over the k (fp32), or sigmoid of each (in h's dtype),
    renormalised to sum 1 when norm_topk_prob (sigmoid only, as transformers).
    """
    logits = F.linear(h, router)  # [N, E]
    top_logits, expert_ids = torch.topk(logits, config.num_experts_per_tok, dim=-1)
    return expert_weights(top_logits, config).to(h.dtype), expert_ids


def expert_weights(chosen_logits: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """The config's selection function on the chosen experts' router logits: [N, k] -> [N, k]
    (softmax in fp32, or sigmoid in the logits' dtype, renormalised when norm_topk_prob)."""
    if config.expert_selection_fn == "softmax":
        return torch.softmax(chosen_logits, dim=-1, dtype=torch.float32)
    weights = torch.sigmoid(chosen_logits)
    if config.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


def swiglu(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate h) * up h): h [N, H]; gate, up [I, H]; down [H, I] -> [N, H]. The dense MLP."""
    return F.linear(F.silu(F.linear(h, gate)) * F.linear(h, up), down)


def run_experts(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor,
                expert_weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum of the selected experts: only experts some token chose are computed.

    h: [N, H]; gate_up: [E, 2I, H] (gate rows, then up rows); down: [E, H, I];
    expert_ids, expert_weights: [N, k]. Experts are added in ascending id order, like transformers.
    """
    k = expert_ids.shape[-1]
    flat = expert_ids.cpu().flatten()  # grouped on the host: one transfer a call, not a GPU sync per expert
    order = torch.argsort(flat, stable=True)  # the (token, slot) pairs of each expert in row-major order,
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)  # as torch.where lists them
    pairs = order.to(h.device)
    tokens, slots = pairs // k, pairs % k
    out = torch.zeros_like(h)
    starts = [0] + torch.cumsum(counts, 0).tolist()
    for expert_id, start, end in zip(experts.tolist(), starts, starts[1:]):  # ascending ids
        token_idx, slot_idx = tokens[start:end], slots[start:end]
        gate, up = F.linear(h[token_idx], gate_up[expert_id]).chunk(2, dim=-1)
        expert_out = F.linear(F.silu(gate) * up, down[expert_id])  # [n, H]
        out.index_add_(0, token_idx, expert_out * expert_weights[token_idx, slot_idx, None])
    return out


def moe(h: torch.Tensor, layer: LayerWeights, config: ModelConfig) -> torch.Tensor:
    """The sparse MLP: routed experts plus the shared experts (sum or average). h: [N, H] -> [N, H]."""
    weights, expert_ids = route(h, layer.router, config)
    out = run_experts(h, layer.experts_gate_up, layer.experts_down, expert_ids, weights)
    if config.num_shared_experts > 0:
        shared = swiglu(h, layer.gate_proj, layer.up_proj, layer.down_proj)
        out = out + shared if config.shared_expert_combination_strategy == "sum" else (out + shared) / 2
    return out


def mlp(h: torch.Tensor, layer: LayerWeights, config: ModelConfig, layer_idx: int) -> torch.Tensor:
    """The layer's MLP branch: dense SwiGLU or MoE. h: [N, H] -> [N, H]."""
    if config.is_dense(layer_idx):
        return swiglu(h, layer.gate_proj, layer.up_proj, layer.down_proj)
    return moe(h, layer, config)


def lm_logits(x: torch.Tensor, final_norm: torch.Tensor, lm_head: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Final norm, LM head and logit_scale. x: [..., H] residual stream -> [..., V] in the model dtype."""
    return F.linear(norm(x, final_norm, config), lm_head) * config.logit_scale


# --- weights ---


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One layer's tensors, from the canonical dict (docs/architecture.md). Unused fields are None.

    gate_proj/up_proj/down_proj hold the dense MLP on a dense layer and the shared experts on a
    sparse layer that has them.
    """

    input_norm: torch.Tensor  # [H]
    q_proj: torch.Tensor  # [Hq*D, H]
    k_proj: torch.Tensor  # [Hkv*D, H]
    v_proj: torch.Tensor  # [Hkv*D, H]
    o_proj: torch.Tensor  # [H, Hq*D]
    gate_proj: torch.Tensor | None = None  # [I_dense or I*S, H]
    up_proj: torch.Tensor | None = None  # [I_dense or I*S, H]
    down_proj: torch.Tensor | None = None  # [H, I_dense or I*S]
    router: torch.Tensor | None = None  # [E, H]
    experts_gate_up: torch.Tensor | None = None  # [E, 2I, H]
    experts_down: torch.Tensor | None = None  # [E, H, I]


def check_weights(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Raise ValueError naming the first missing or wrong-shaped tensor, and any unexpected ones."""
    shapes = canonical_shapes(config)
    for name, shape in shapes.items():
        if name not in weights:
            raise ValueError(f"weights: tensor {name} is missing (expected shape {list(shape)})")
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"weights: tensor {name} has shape {list(weights[name].shape)}, expected {list(shape)}")
    unexpected = sorted(set(weights) - set(shapes))
    if unexpected:
        raise ValueError(f"weights: unexpected tensors {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")


def layer_weights(config: ModelConfig, weights: dict[str, torch.Tensor], layer_idx: int) -> LayerWeights:
    p = f"model.layers.{layer_idx}."
    mlp_prefix = p + ("mlp." if config.is_dense(layer_idx) else "mlp.shared_experts.")
    return LayerWeights(
        input_norm=weights[p + "input_layernorm.weight"],
        q_proj=weights[p + "self_attn.q_proj.weight"], k_proj=weights[p + "self_attn.k_proj.weight"],
        v_proj=weights[p + "self_attn.v_proj.weight"], o_proj=weights[p + "self_attn.o_proj.weight"],
        gate_proj=weights.get(mlp_prefix + "gate_proj.weight"), up_proj=weights.get(mlp_prefix + "up_proj.weight"),
        down_proj=weights.get(mlp_prefix + "down_proj.weight"), router=weights.get(p + "mlp.gate.weight"),
        experts_gate_up=weights.get(p + "mlp.experts.gate_up_proj"),
        experts_down=weights.get(p + "mlp.experts.down_proj"),
    )


# --- the contiguous KV cache and the model ---


class KVCache:
    """Per layer K (after RoPE) and V of a batch of B sequences of the same length, contiguous.

    keys[l], values[l]: [B, capacity, Hkv, D]; positions 0..seq_len-1 are filled. Sliding layers keep
    every position too (the attention mask applies the window); storage doubles as it fills.
    """

    def __init__(self, num_layers: int, batch_size: int = 1) -> None:
        self.batch_size = batch_size
        self.seq_len = 0  # tokens of each sequence already in every layer
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def append(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v: [B, T, Hkv, D] at positions seq_len.. of this layer; return all [B, seq_len+T, Hkv, D]."""
        end = self.seq_len + k.shape[1]
        stored = self.keys[layer_idx]
        if stored is None or stored.shape[1] < end:
            capacity = max(end, 2 * (0 if stored is None else stored.shape[1]), 16)
            self.keys[layer_idx] = self._grown(stored, k, capacity)
            self.values[layer_idx] = self._grown(self.values[layer_idx], v, capacity)
        self.keys[layer_idx][:, self.seq_len:end] = k
        self.values[layer_idx][:, self.seq_len:end] = v
        return self.keys[layer_idx][:, :end], self.values[layer_idx][:, :end]

    def _grown(self, stored: torch.Tensor | None, like: torch.Tensor, capacity: int) -> torch.Tensor:
        grown = like.new_zeros((like.shape[0], capacity, *like.shape[2:]))
        if stored is not None:
            grown[:, :self.seq_len] = stored[:, :self.seq_len]
        return grown


class NorthModel:
    """cohere2_moe forward over a contiguous KV cache: prefill, incremental decode, greedy generation.

    Weights are the canonical dict (docs/architecture.md) on one device in one dtype; the model
    computes in that dtype (fp32 or bf16), on the CPU or a GPU.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        check_weights(config, weights)
        self.config = config
        self.embed = weights["model.embed_tokens.weight"]  # [V, H]
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.final_norm = weights["model.norm.weight"]  # [H]
        self.lm_head = weights["lm_head.weight"]  # [V, H], the embedding itself when tied
        self.layers = [layer_weights(config, weights, i) for i in range(config.num_hidden_layers)]
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta).to(self.device)  # [D/2] fp32

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike, device: str | torch.device = "cpu",
                 dtype: torch.dtype | str | None = None, progress: ProgressCallback | None = None) -> NorthModel:
        """Load a checkpoint folder (either expert layout) onto `device`; dtype None keeps the files' dtype."""
        config, weights = load_checkpoint(model_dir, device=device, dtype=dtype, progress=progress)
        return cls(config, weights)

    def new_cache(self, batch_size: int = 1) -> KVCache:
        return KVCache(self.config.num_hidden_layers, batch_size)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, cache: KVCache | None = None, last_only: bool = False) -> torch.Tensor:
        """token_ids: [B, T] at positions cache.seq_len.. (0 without a cache) -> logits [B, T or 1, V].

        With a cache, the new tokens' K/V are appended to it (prefill, chunked prefill and decode
        are all this call); without one the T tokens are the whole sequence.
        """
        cfg = self.config
        start = cache.seq_len if cache is not None else 0
        assert cache is None or cache.batch_size == token_ids.shape[0], "batch size differs from the cache's"
        positions = torch.arange(start, start + token_ids.shape[1], device=self.device)  # [T]
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.dtype)  # [T, D]
        x = F.embedding(token_ids.to(self.device), self.embed)  # [B, T, H]
        for i, layer in enumerate(self.layers):
            h = norm(x, layer.input_norm, cfg)
            attn = self._attention(i, layer, h, positions, cos, sin, cache)
            x = x + attn + mlp(h.flatten(0, 1), layer, cfg, i).view_as(h)  # the parallel block
        if cache is not None:
            cache.seq_len += token_ids.shape[1]
        if last_only:
            x = x[:, -1:]
        return lm_logits(x, self.final_norm, self.lm_head, cfg)

    def _attention(self, layer_idx: int, layer: LayerWeights, h: torch.Tensor, positions: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        """h: [B, T, H] normed -> o_proj(attention) [B, T, H]; appends K/V to the cache."""
        q, k, v = project_qkv(h, layer, self.config)  # [B, T, heads, D]
        if self.config.uses_rope(layer_idx):
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.append(layer_idx, k, v)
        k_positions = torch.arange(k.shape[1], device=self.device)  # [S]
        window = self.config.window(layer_idx)
        if window is not None:  # keys behind every query's window can be skipped
            first = max(0, int(positions[0]) - window + 1)
            k, v, k_positions = k[:, first:], v[:, first:], k_positions[first:]
        return F.linear(attention(q, k, v, positions, k_positions, window), layer.o_proj)

    # --- conveniences over forward ---

    def prefill(self, token_ids: Sequence[int] | torch.Tensor, cache: KVCache,
                last_only: bool = False) -> torch.Tensor:
        """Run prompt tokens [T] (one sequence) or [B, T] into the cache -> logits [T, V] or [B, T, V]."""
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        logits = self.forward(ids.view(1, -1) if ids.dim() == 1 else ids, cache, last_only)
        return logits[0] if ids.dim() == 1 else logits

    def decode(self, token_ids: int | Sequence[int] | torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One token per sequence: an int (-> logits [V]) or B ids (-> [B, V]), appended to the cache."""
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        logits = self.forward(ids.view(-1, 1), cache)[:, 0]
        return logits[0] if ids.dim() == 0 else logits

    def greedy_generate(self, prompt_ids: Sequence[int], max_new_tokens: int,
                        stop_ids: Sequence[int] | None = None) -> list[int]:
        """Argmax decoding with the cache; stops after a stop id (the config's EOS ids by default),
        which is included in the result, as in transformers' generate."""
        stop = set(self.config.eos_token_ids if stop_ids is None else stop_ids)
        cache = self.new_cache()
        logits = self.prefill(prompt_ids, cache, last_only=True)[-1]
        generated: list[int] = []
        while len(generated) < max_new_tokens:
            token = int(torch.argmax(logits))
            generated.append(token)
            if token in stop or len(generated) == max_new_tokens:
                break
            logits = self.decode(token, cache)
        return generated
