"""The megakernel's whole-step oracle: one decode step of one row through model.py's building blocks, in
a chosen dtype, optionally FOLLOWING a given expert choice at every sparse layer, recording what the checks
need (the residual each layer reads, router logits and the path's own top-k, the K/V it appends).

Why three paths and why follow. With random weights the top-k boundary of 128 router logits is often
closer than bf16 rounding, and one different expert changes the rest of the step (and, through the KV,
every later step), so comparing the kernel with the bf16 torch path directly mixes arithmetic error with
routing chaos. The checks therefore run an fp32 path (`dtype=torch.float32`: bf16 weights and KV upcast,
the accurate answer) and the bf16 torch path (`dtype=torch.bfloat16`: op for op NorthModel.decode) that
both follow the kernel's experts, and ask whether the kernel's distance to fp32 is within a small factor
of the bf16 torch path's own distance. Routing is judged separately: the kernel may pick a different
expert only where fp32's top-k gap is within what bf16 arithmetic can move (`compare_routing`).

Without `follow` and in bf16, `Oracle.step` equals NorthModel.decode bit for bit (tests/test_megakernel_oracle.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from northcode.config import ModelConfig
from northcode.model.model import expert_weights


@dataclass
class OracleStep:
    """What one row's decode step computed on one path."""

    logits: torch.Tensor  # [V] fp32 (the path's logits, upcast)
    residual: torch.Tensor  # [L + 1, H] fp32: the residual layer l reads (row L: the final norm's input)
    router: torch.Tensor  # [L, E] fp32 router logits as the path computed them (zeros on dense layers)
    own_experts: torch.Tensor  # [L, k] int64: the path's own top-k (-1 on dense layers)
    keys: torch.Tensor  # [L, KVH, D] this step's K (after RoPE) in the path's dtype
    values: torch.Tensor  # [L, KVH, D]


class _CastRows:
    """tensor[e] cast to dtype on access (the experts of a layer, upcast only when routed)."""

    def __init__(self, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        self.tensor, self.dtype = tensor, dtype

    def __getitem__(self, index):
        return self.tensor[index].to(self.dtype)


class Oracle:
    """Decode steps of single rows over a model.KVCache-like history, in `dtype`, from bf16 canonical weights.

    Non-expert weights are cast once and kept (fp32 North Mini Code: ~6 GB of attention, dense MLP and
    LM head); experts are cast per routed expert per step."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        from northcode.model.model import check_weights, rope_inv_freq

        check_weights(config, weights)
        if config.num_shared_experts:
            raise ValueError("decode oracle: shared experts are not supported (nor is the megakernel)")
        self.config, self.weights, self.dtype = config, weights, dtype
        self.device = weights["model.embed_tokens.weight"].device
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta).to(self.device)
        self._cast: dict[str, torch.Tensor] = {}

    def w(self, name: str) -> torch.Tensor:
        tensor = self.weights[name]
        if tensor.dtype == self.dtype:
            return tensor
        if name not in self._cast:
            self._cast[name] = tensor.to(self.dtype)
        return self._cast[name]

    def step(self, token: int, position: int, keys: list[torch.Tensor], values: list[torch.Tensor],
             follow: torch.Tensor | None = None) -> OracleStep:
        """One token at `position` of one sequence. keys[l], values[l]: [>= position, KVH, D] history
        (bf16 or the path's dtype; rows >= position are ignored). follow: int [L, k] experts to use at
        each sparse layer (None: the path's own top-k)."""
        return self.steps([token], [position], [(keys, values)], None if follow is None else follow[None])[0]

    @torch.inference_mode()
    def steps(self, tokens: list[int], positions: list[int], histories: list[tuple[list, list]],
              follow: torch.Tensor | None = None) -> list[OracleStep]:
        """`step` for N rows at once, each its own sequence: the projections, router, experts and LM head take
        the rows together, attention goes row by row (its own history and window). histories: per row (keys,
        values) as `step` takes them; follow: int [N, L, k] or None. One row is `step` op for op. The teacher-
        forced checks step every row of a batch each step (one row at a time, ~0.3 s a row-step at 49 layers,
        made B=8 x 256 steps a 10-minute device call)."""
        from northcode.model import model as m

        c, dt, dev = self.config, self.dtype, self.device
        L, k, n = c.num_hidden_layers, c.num_experts_per_tok, len(tokens)
        rows = torch.tensor(positions, device=dev)[:, None]  # [N, 1]: each row's one position
        cos, sin = m.rope_cos_sin(rows, self.inv_freq, dt)  # [N, 1, D]
        x = F.embedding(torch.tensor(tokens, device=dev)[:, None], self.weights["model.embed_tokens.weight"]).to(dt)
        residual = torch.zeros(n, L + 1, c.hidden_size, device=dev)
        router = torch.zeros(n, L, c.num_experts, device=dev)
        own = torch.full((n, L, k), -1, dtype=torch.long, device=dev)
        new_k = torch.empty(n, L, c.num_key_value_heads, c.head_dim, dtype=dt, device=dev)
        new_v = torch.empty_like(new_k)
        follow_here = None if follow is None else follow.to(dev).long()  # route_weights gathers with it
        for i in range(L):
            p = f"model.layers.{i}."
            residual[:, i] = x.reshape(n, -1).float()
            h = m.norm(x, self.w(p + "input_layernorm.weight"), c)  # [N, 1, H]
            q = F.linear(h, self.w(p + "self_attn.q_proj.weight")).unflatten(-1, (-1, c.head_dim))
            kk = F.linear(h, self.w(p + "self_attn.k_proj.weight")).unflatten(-1, (-1, c.head_dim))
            vv = F.linear(h, self.w(p + "self_attn.v_proj.weight")).unflatten(-1, (-1, c.head_dim))
            if c.uses_rope(i):
                q, kk = m.apply_rope(q, cos, sin), m.apply_rope(kk, cos, sin)
            new_k[:, i], new_v[:, i] = kk[:, 0], vv[:, 0]
            window = c.window(i)
            outs = []
            for b, (position, (keys, values)) in enumerate(zip(positions, histories)):
                first = max(0, position - window + 1) if window else 0
                all_k = torch.cat([keys[i][first:position].to(dt), kk[b]])[None]  # [1, S, KVH, D]
                all_v = torch.cat([values[i][first:position].to(dt), vv[b]])[None]
                k_positions = torch.arange(first, position + 1, device=dev)
                outs.append(m.attention(q[b:b + 1], all_k, all_v, rows[b], k_positions, window))
            attn = F.linear(torch.cat(outs), self.w(p + "self_attn.o_proj.weight"))  # [N, 1, H]
            h2 = h.flatten(0, 1)  # [N, H]
            if c.is_dense(i):
                mlp = m.swiglu(h2, self.w(p + "mlp.gate_proj.weight"), self.w(p + "mlp.up_proj.weight"),
                               self.w(p + "mlp.down_proj.weight"))
            else:
                logits = F.linear(h2, self.w(p + "mlp.gate.weight"))  # [N, E] in dt, as model.route
                router[:, i] = logits.float()
                own[:, i] = torch.topk(logits, k, dim=-1).indices
                ids = own[:, i] if follow is None else follow_here[:, i]
                weights = route_weights(logits, ids, c)
                # a host copy of followed ids: run_experts groups the rows by expert on the host, without a sync
                mlp = m.run_experts(h2, _CastRows(self.weights[p + "mlp.experts.gate_up_proj"], dt),
                                    _CastRows(self.weights[p + "mlp.experts.down_proj"], dt),
                                    ids if follow is None else follow[:, i], weights)
            x = x + attn + mlp.view_as(h)  # the parallel block, as NorthModel.forward
        residual[:, L] = x.reshape(n, -1).float()
        logits = m.lm_logits(x, self.w("model.norm.weight"), self.w("lm_head.weight"), c)
        logits = logits.reshape(n, -1).float()
        return [OracleStep(logits[b], residual[b], router[b], own[b], new_k[b], new_v[b]) for b in range(n)]


def route_weights(logits: torch.Tensor, ids: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """model.route's weights for given expert ids: logits [N, E], ids [N, k] -> [N, k] in logits' dtype."""
    return expert_weights(logits.gather(-1, ids), config).to(logits.dtype)


# --- comparisons ---


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in fp32 (inf when got has non-finite values)."""
    got, ref = got.float(), ref.float()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def logit_errors(got: torch.Tensor, ref: torch.Tensor) -> dict:
    """Relative error, 1 - cosine and largest |difference| of logits [V] against the fp32 reference."""
    return dict(rel=rel_err(got, ref), one_minus_cos=float(1 - F.cosine_similarity(got.float(), ref, dim=0)),
                max_abs=float((got.float() - ref).abs().max()))


def swap_margin(chosen: set[int], logits: torch.Tensor, k: int) -> float:
    """How far a chosen top-k set is from the top-k of `logits` [E] (fp32): 0 when they agree, else the
    largest fp32 logit left out minus the smallest one taken in its place (> 0)."""
    top = set(torch.topk(logits, k).indices.tolist())
    if chosen == top:
        return 0.0
    missed = max(float(logits[e]) for e in top - chosen)
    taken = min(float(logits[e]) for e in chosen - top)
    return max(missed - taken, 0.0)


def compare_routing(config: ModelConfig, kernel_experts: torch.Tensor, kernel_router: torch.Tensor | None,
                    exact: OracleStep, bf16: OracleStep) -> list[dict]:
    """Per sparse layer of one row and step: fp32's own top-k gap (k-th minus (k+1)-th logit), whether and by
    how much the kernel's experts and the bf16 torch path's own experts differ from fp32's own choice
    (swap_margin), and each path's router-logit error against fp32 (max |difference|; the kernel's only
    when its router trace is given). kernel_experts: [L, k]; kernel_router: [L, E] or None."""
    k = config.num_experts_per_tok
    exact_router, torch_router, torch_own = exact.router.cpu(), bf16.router.cpu(), bf16.own_experts.cpu()
    kernel_experts = kernel_experts.cpu()
    kernel_router = kernel_router.float().cpu() if kernel_router is not None else None
    records = []
    for layer in range(config.num_hidden_layers):
        if config.is_dense(layer):
            continue
        z = exact_router[layer]
        top = torch.topk(z, k + 1).values
        record = dict(layer=layer, gap=float(top[k - 1] - top[k]),
                      kernel_margin=swap_margin(set(kernel_experts[layer].tolist()), z, k),
                      torch_margin=swap_margin(set(torch_own[layer].tolist()), z, k),
                      torch_router_err=float((torch_router[layer] - z).abs().max()))
        if kernel_router is not None:
            record["kernel_router_err"] = float((kernel_router[layer] - z).abs().max())
        records.append(record)
    return records


def rel_errs(got: torch.Tensor, ref: torch.Tensor) -> list[float]:
    """rel_err of each row of got [N, H] against ref [N, H], in one pass (one device sync for all rows)."""
    got, ref = got.float(), ref.float()
    errors = (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)
    return torch.where(torch.isfinite(got).all(dim=-1), errors, torch.inf).tolist()


def residual_errors(kernel_residual: torch.Tensor | None, exact: OracleStep, bf16: OracleStep) -> list[dict]:
    """Per layer l (and the final norm's input, l = L): relative error of the residual layer l reads, for the
    kernel (its trace, [L + 1, H], when given) and the bf16 torch path, against the fp32 path."""
    torch_errors = rel_errs(bf16.residual, exact.residual)
    rows = [dict(layer=layer, torch=error) for layer, error in enumerate(torch_errors)]
    if kernel_residual is not None:
        for row, error in zip(rows, rel_errs(kernel_residual.to(exact.residual.device), exact.residual)):
            row["kernel"] = error
    return rows


def first_jump(per_layer: list[dict], factor: float, floor: float) -> int | None:
    """The first layer whose kernel residual error exceeds factor x the bf16 torch path's + floor (None: none)."""
    for row in per_layer:
        if "kernel" in row and row["kernel"] > factor * row["torch"] + floor:
            return row["layer"]
    return None
