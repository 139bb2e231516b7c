"""The torch.compile'd decode step (gpt-fast style): the eager step's math as inductor-friendly functions.

Three functions are compiled per batch bucket (dynamic=False, fullgraph=True, no cudagraphs of inductor's
own: backend.py captures the step in its CUDA graph as it does the eager one):
  - `prepare_step`: embedding, the first norm, RoPE cos/sin, the write slots of every layer, and per layer
    kind (full, sliding) the paged block mask of every layer: kv_indices (the physical pages, int32
    [L_kind, B, P]), kv_num_blocks ([B]: pages up to the row's position), the first and last page of each
    row (only those can be partly visible) and the offsets that bound them;
  - `layer_step`, one compiled graph per layer kind shared by its layers (the weights are arguments):
    QKV + router GEMM, RoPE, the K/V write into the pool (in place), attention with flex_attention
    reading the K/V pages where they lie (no gather: the pool is the key/value tensor and the block mask
    lists the row's pages; the flex-decoding kernel splits them over the SMs), o_proj, the MLP (dense or
    routed experts), the residual adds, and the next layer's norm (the final norm after the last layer);
  - `head_step`: LM head and logit scale.
Nothing in the shapes depends on the context length (the block mask is data), so one compiled step and one
CUDA graph per batch bucket serve every context: no recompile, no capture while serving. Per layer kind, not
the 49 layers unrolled, keeps a bucket's compile to five small graphs. CompiledDecode (below) runs them,
compiles a bucket at warm-up and checks it against the eager step there (backend.py falls back on failure).
At batches 1 and 2 on a GPU the bucket compiles with coordinate-descent tuning, which turns every small-M GEMM
into inductor's GEMV (its mm/bmm decompositions, as gpt-fast): the weights stream near peak bandwidth instead of
cuBLAS's ~1.6 TB/s at M = 1-8, and the routed experts take the gathered path (routed_experts.py), whose gather
of the chosen experts' weights becomes the GEMV's indirect loads (no copy). Larger buckets keep cuBLAS and
the grouped GEMM (at 8K, GEMVs were -12% at B=2, -6% at B=4, +16% at B=8, where every row reads its own
experts; a GEMV bucket compiles in ~65 s against 15-30 s): GEMV_MAX_BATCH, below.
Results equal the eager step's to the model dtype's rounding (GEMV sums in fp32 in another order; flex
keeps the scores in fp32 where the eager bmm rounds them to the model dtype).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from northcode.config import env_torch_compile
from northcode.model.model import apply_rope, rope_cos_sin
from northcode.torch_backend.routed_experts import gathered_pair_outputs, grouped_pair_outputs, route_logits

Q_BLOCK = 128  # the block mask's query block: one decode query; flex decoding needs a multiple of 16


@dataclasses.dataclass(frozen=True, slots=True)
class StepSpec:
    """What prepare_step and head_step specialise on (equal specs share a compiled graph)."""

    page_size: int
    rms: bool  # RMSNorm, else LayerNorm without bias
    eps: float
    window: int | None  # sliding window in tokens; None: no sliding layer
    window_pages: int  # pages a sliding layer reads at most
    has_full: bool
    pad_indices_to: int  # kv_indices columns at least: 0 on a GPU; the pool's pages on the CPU (its flex needs them)
    logit_scale: float


@dataclasses.dataclass(frozen=True, slots=True)
class LayerSpec:
    """What layer_step specialises on: one per layer kind. Its field names for routing are the config's
    (route_logits reads num_experts_per_tok, expert_selection_fn, norm_topk_prob)."""

    rms: bool
    eps: float
    page_size: int
    num_kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    qkv_size: int  # columns of the fused GEMM output that are QKV (the router's follow on sparse layers)
    rope: bool
    sliding: bool
    dense: bool
    moe_path: str  # "grouped" | "gathered" (routed_experts.py)
    num_experts_per_tok: int
    expert_selection_fn: str
    norm_topk_prob: bool
    shared: str | None  # shared experts: None, "sum" or "mean" (model.moe)
    flex_decode: bool  # CUDA: force the flex-decoding kernel (an error, not a slow kernel, if it cannot run)


def normed(x: torch.Tensor, weight: torch.Tensor, rms: bool, eps: float) -> torch.Tensor:
    """backend.norm: x [..., H] -> same dtype (fp32 statistics)."""
    if rms:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.layer_norm(x, (x.shape[-1],), weight, None, eps)


# --- the compiled functions ---

def prepare_step(token_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, page_of: torch.Tensor,
                 embed: torch.Tensor, inv_freq: torch.Tensor, first_norm: torch.Tensor, full_layers: torch.Tensor,
                 sliding_layers: torch.Tensor, spec: StepSpec):
    """token_ids, positions, rows: long [B] -> (x [B, H], h = first norm of x, cos, sin [B, D], write_slots
    long [L, B], full view, sliding view); a view is (kv_indices int32 [L_kind, B, width], kv_num_blocks
    int32 [B], first_page int32 [L_kind, B], first_offset [B], last_page int32 [L_kind, B], last_offset [B]);
    None for a kind the model lacks."""
    ps = spec.page_size
    x = F.embedding(token_ids, embed)  # [B, H]
    h = normed(x, first_norm, spec.rms, spec.eps)
    cos, sin = rope_cos_sin(positions, inv_freq, embed.dtype)  # [B, D]
    last_logical = positions // ps  # [B]: the page of the new token
    write_slots = page_of[:, rows, last_logical] * ps + positions % ps  # [L, B]
    full = sliding = None
    if spec.has_full:
        pages = page_of[full_layers[:, None], rows[None, :]]  # [L_full, B, max_pages]
        full = _kind_view(pages, torch.zeros_like(positions), last_logical, positions, spec)
    if spec.window is not None:
        first = (positions - spec.window + 1).clamp(min=0)  # [B] the window's first position
        first_logical = first // ps
        page_idx = first_logical[:, None] + torch.arange(spec.window_pages, device=positions.device)  # [B, W_p]
        page_idx = page_idx.clamp(max=page_of.shape[-1] - 1)  # past the table: never read (kv_num_blocks)
        pages = page_of[sliding_layers[:, None, None], rows[None, :, None], page_idx[None]]  # [L_sliding, B, W_p]
        sliding = _kind_view(pages, first, last_logical - first_logical, positions, spec)
    return x, h, cos, sin, write_slots, full, sliding


def _kind_view(pages: torch.Tensor, first: torch.Tensor, last_block: torch.Tensor, positions: torch.Tensor,
               spec: StepSpec):
    """pages long [L_kind, B, P] from the first visible page on; first: the first visible position [B];
    last_block: the index in pages of the new token's page [B]."""
    ps = spec.page_size
    indices = pages.to(torch.int32)
    if spec.pad_indices_to > indices.shape[-1]:  # CPU: pad to the pool's page count (never read)
        indices = F.pad(indices, (0, spec.pad_indices_to - indices.shape[-1]))
    last = indices.gather(2, last_block[None, :, None].expand(indices.shape[0], -1, 1))[..., 0]  # [L_kind, B]
    num_blocks = (last_block + 1).to(torch.int32)
    # the mask's tensors contiguous: inductor's CPU flex template takes no strided mask inputs
    return indices, num_blocks, indices[:, :, 0].contiguous(), first % ps, last.contiguous(), positions % ps


def layer_step(x: torch.Tensor, h: torch.Tensor, weights: tuple, pool: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, write_slots: torch.Tensor, view: tuple, next_norm: torch.Tensor,
               expert_range: torch.Tensor, spec: LayerSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, H] residual, h [B, H] its norm -> (x + attention(h) + MLP(h), next layer's norm of it).

    weights: (qkv [+router] [QKV (+E), H], o_proj [H, Hq*D], then dense gate_up [2I, H] and down [H, I], or
    the experts' gate_up [E, 2I, H] and down [E, H, I] (+ shared gate, up, down)); pool: the backend's
    kv_pool [2, pages, ps, Hkv, D], written in place; write_slots long [B]; view: this layer's
    (kv_indices [B, width], kv_num_blocks [B], first_page [B], first_offset [B], last_page [B], last_offset [B])."""
    batch, group, kv_heads, head_dim = x.shape[0], spec.group, spec.num_kv_heads, spec.head_dim
    qkv_router = F.linear(h, weights[0])  # [B, QKV (+E)]
    qkv = qkv_router[:, :spec.qkv_size].view(batch, group + 2, kv_heads, head_dim)  # slot-major
    rotated = qkv[:, :group + 1]  # the query slots and K
    if spec.rope:
        rotated = apply_rope(rotated, cos[:, None], sin[:, None])
    kv = torch.stack([rotated[:, group], qkv[:, group + 1]], dim=1)  # [B, 2, Hkv, D]
    # into the pool itself, never a view of it: torch 2.11's reinplace pass writes a graph input in place only
    # when it is the scatter's target; a scatter into a view stays functional: a pool-sized copy every layer
    pages, offsets = write_slots // spec.page_size, write_slots % spec.page_size  # [B] each
    pool.index_put_((torch.arange(2, device=x.device)[None, :], pages[:, None], offsets[:, None]), kv)
    queries = rotated[:, :group].permute(0, 2, 1, 3).reshape(batch, kv_heads * group, 1, head_dim)
    attn = paged_attention(queries, pool, view, spec)  # [B, Hq, 1, D]
    x = x + F.linear(attn.reshape(batch, -1), weights[1])
    if spec.dense:
        gate, up = F.linear(h, weights[2]).chunk(2, dim=-1)  # [B, I] each
        x = x + F.linear(F.silu(gate) * up, weights[3])
    else:
        x = add_moe(x, h, weights, qkv_router[:, spec.qkv_size:], expert_range, spec)
    return x, normed(x, next_norm, spec.rms, spec.eps)


def paged_attention(queries: torch.Tensor, pool: torch.Tensor, view: tuple, spec: LayerSpec) -> torch.Tensor:
    """queries [B, Hq, 1, D] over the row's K/V pages in the pool, in place: flex_attention with the pool as
    keys and values ([1, Hkv, slots, D], one batch broadcast over the rows) and a block mask of the row's
    pages (one block = one page). Inside the first and last page the mask hides by offset: keys before the
    window's start (sliding layers) and slots after the new token, which hold stale data."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    indices, num_blocks, first_page, first_offset, last_page, last_offset = view
    batch, ps = queries.shape[0], spec.page_size
    slots = pool.shape[1] * ps
    keys = pool[0].view(1, slots, spec.num_kv_heads, spec.head_dim).transpose(1, 2)  # [1, Hkv, slots, D]
    values = pool[1].view(1, slots, spec.num_kv_heads, spec.head_dim).transpose(1, 2)

    def visible(b, h, q_idx, kv_idx):
        page, offset = kv_idx // ps, kv_idx % ps
        seen = (page != last_page[b]) | (offset <= last_offset[b])
        if spec.sliding:
            seen = seen & ((page != first_page[b]) | (offset >= first_offset[b]))
        return seen

    mask = BlockMask.from_kv_blocks(num_blocks.view(batch, 1, 1), indices.view(batch, 1, 1, -1),
                                    BLOCK_SIZE=(Q_BLOCK, ps), mask_mod=visible, seq_lengths=(1, slots),
                                    compute_q_blocks=False)
    options = {"BACKEND": "TRITON_DECODE"} if spec.flex_decode else None
    return flex_attention(queries, keys, values, block_mask=mask, scale=spec.head_dim ** -0.5, enable_gqa=True,
                          kernel_options=options)


def add_moe(x: torch.Tensor, h: torch.Tensor, weights: tuple, router_logits: torch.Tensor,
            expert_range: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    """x [N, H] + the sparse MLP of h (routed_experts.add_moe's math, out of place)."""
    expert_weights, expert_ids = route_logits(router_logits, spec)  # [N, k] each
    if spec.moe_path == "gathered":
        pair_out = gathered_pair_outputs(h, weights[2], weights[3], expert_ids)  # [N, k, H]
    else:
        pair_out = grouped_pair_outputs(h, weights[2], weights[3], expert_ids, expert_range)
    routed = (pair_out.float() * expert_weights.float()[:, :, None]).sum(dim=1)  # [N, H] fp32
    if spec.shared is None:
        return (x + routed).to(x.dtype)
    shared = F.linear(F.silu(F.linear(h, weights[4])) * F.linear(h, weights[5]), weights[6])
    total = routed.to(x.dtype) + shared
    return x + (total if spec.shared == "sum" else total / 2)


def head_step(h: torch.Tensor, lm_head: torch.Tensor, spec: StepSpec) -> torch.Tensor:
    """h [B, H] (final norm applied) -> fp32 logits [B, V]."""
    logits = F.linear(h, lm_head)
    if spec.logit_scale != 1.0:
        logits = logits * spec.logit_scale
    return logits.float()


# --- the driver ---

GEMV_MAX_BATCH = 2  # on a GPU, the largest batch bucket compiled with inductor's GEMVs (why: the docstring above)
RECOMPILE_LIMIT = 512  # graphs per compiled function: kinds x buckets x backends of other shapes (tests)
CHECK_LAYER_COS_MIN = 0.9  # warm-up check, per layer: rounding gives ~0.9999, a swapped expert ~0.97, a bug ~0
CHECK_LOGITS_COS_MIN = 0.99  # and the LM head on the same input
MEMORY_SLACK_BYTES = 64 << 20  # a step's own temporaries (logits, split-KV partials, MoE rows) stay below this


# gemv? -> the compiled (prepare_step, layer_step, head_step), shared by every backend of the process: dynamo
# keeps a function's graphs with the backend object that compiled them, so one wrapper per setting lets a new
# backend (a restart, a bench cell) of the same shapes run the graphs compiled before, without compiling
_COMPILED: dict[bool, tuple] = {}


class CompileCheckError(RuntimeError):
    """The compiled step disagrees with the eager step at warm-up: it is not used."""


def compile_requested(compile: bool | None, device: torch.device, cuda_graphs: bool = True) -> bool:
    """compile=True/False wins; None: NORTHCODE_TORCH_COMPILE=0/1 when set, else on where the step runs in CUDA
    graphs on a GPU (H200: 208 tok/s at batch 1 against 133 for the eager graph, every layer within
    bf16 rounding of the eager step; the price is a compile per batch bucket at warm-up, ~65-90 s for the GEMV
    buckets (1, 2) and ~15-30 s for the others cold, less from inductor's cache). Off on the CPU (inductor's CPU
    code needs a C++ compiler and gains little there) and without CUDA graphs (a prefiller or a reference)."""
    if compile is not None:
        return compile
    chosen = env_torch_compile()
    if chosen is not None:
        return chosen
    return device.type == "cuda" and cuda_graphs


def compiled_pool_pages(config, page_size: int) -> int:
    """The most KV pages the compiled step can run over: its pool [2, pages + 1 (scratch), ps, Hkv, D] must stay
    under 2^31 elements. Past that inductor indexes it with 64-bit offsets, and in torch 2.11 the flex_attention
    template then fails to compile in Triton ("Ternary expression with dynamic condition has inconsistent types
    int64 and int32": a 68 GB engine pool on the H200; the decode bench's pools at 32K x 4 rows and
    128K x 2, which share pages across layers: 12 full layers each hold the whole context). The engine caps its pool
    here; the bench times the eager step past it and says so."""
    per_page = 2 * page_size * config.num_key_value_heads * config.head_dim
    return (2 ** 31 - 1) // per_page - 1


def _dynamo_limits():
    """Room for every bucket's graphs, and an error instead of a silent eager fallback past the limit
    (eager flex_attention would score every slot of the pool)."""
    return torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=4 * RECOMPILE_LIMIT,
                                      fail_on_recompile_limit_hit=True)


class CompiledDecode:
    """The compiled decode step over a TorchBackend's weights, pools and block tables; called like
    DecodeStep (its num_full_pages is not needed: every context length runs the same graph)."""

    def __init__(self, backend) -> None:
        cfg, device, ps = backend.config, backend.device, backend.page_size
        self.backend, self.config = backend, cfg
        self.gemv_max_batch = GEMV_MAX_BATCH if device.type == "cuda" else 0  # inductor's GEMVs up to here
        self.ready: dict[int, float] = {}  # batch bucket -> seconds its compile and check took
        window_pages = min(-(-cfg.sliding_window // ps) + 1, backend.max_pages_per_seq) if cfg.sliding_window else 0
        layer_ids = {sliding: [i for i in range(cfg.num_hidden_layers) if (cfg.window(i) is not None) == sliding]
                     for sliding in (False, True)}
        self.kind_layers = {k: torch.tensor(v, dtype=torch.long, device=device) for k, v in layer_ids.items()}
        self.position_in_kind = [layer_ids[cfg.window(i) is not None].index(i) for i in range(cfg.num_hidden_layers)]
        pool_pages = backend.kv_pool.shape[1]
        self.step_spec = StepSpec(ps, cfg.uses_rms_norm, cfg.norm_eps, cfg.sliding_window if layer_ids[True] else None,
                                  window_pages, bool(layer_ids[False]), pool_pages if device.type == "cpu" else 0,
                                  cfg.logit_scale)
        self.layer_specs = {gemv: [self._layer_spec(i, gemv) for i in range(cfg.num_hidden_layers)]
                            for gemv in (False, True)}
        self.layer_weights = [self._weights(i) for i in range(cfg.num_hidden_layers)]
        self.next_norms = [layer.input_norm for layer in backend.layers[1:]] + [backend.final_norm]

    def _layer_spec(self, i: int, gemv: bool) -> LayerSpec:
        cfg, backend = self.config, self.backend
        # grouped: the grouped GEMM, whose meta function (what compile traces) takes bf16 only, even on the CPU
        grouped = not gemv and backend.dtype == torch.bfloat16
        moe_path = "grouped" if grouped else "gathered"
        shared = None if cfg.num_shared_experts == 0 else cfg.shared_expert_combination_strategy
        return LayerSpec(cfg.uses_rms_norm, cfg.norm_eps, backend.page_size, cfg.num_key_value_heads,
                         cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim, backend.qkv_size,
                         cfg.uses_rope(i), cfg.window(i) is not None, cfg.is_dense(i), moe_path,
                         cfg.num_experts_per_tok, cfg.expert_selection_fn, cfg.norm_topk_prob,
                         None if shared is None else ("sum" if shared == "sum" else "mean"),
                         backend.device.type == "cuda")

    def _weights(self, i: int) -> tuple:
        backend, layer = self.backend, self.backend.layers[i]
        if self.config.is_dense(i):
            return backend.qkv_proj[i], layer.o_proj, backend.dense_gate_up[i], layer.down_proj
        shared = (layer.gate_proj, layer.up_proj, layer.down_proj) if self.config.num_shared_experts else ()
        return (backend.qkv_proj[i], layer.o_proj, layer.experts_gate_up, layer.experts_down) + shared

    def uses_gemv(self, batch: int) -> bool:
        """Whether this batch size compiles with coordinate-descent tuning: small-M GEMMs as inductor GEMVs."""
        return batch <= self.gemv_max_batch

    def functions(self, batch: int) -> tuple:
        """The compiled (prepare_step, layer_step, head_step) for a batch size; compiled on their first call."""
        gemv = self.uses_gemv(batch)
        if gemv not in _COMPILED:
            options = {"coordinate_descent_tuning": True} if gemv else None
            _COMPILED[gemv] = tuple(torch.compile(fn, dynamic=False, fullgraph=True, options=options)
                                    for fn in (prepare_step, layer_step, head_step))
        return _COMPILED[gemv]

    def __call__(self, token_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                 num_full_pages: int | None = None, residuals: list | None = None) -> torch.Tensor:
        """token_ids, positions, rows: long [B] -> fp32 logits [B, V]; K/V of the new tokens written.
        residuals: a list to append the residual stream [B, H] to, the embedding and then after each layer
        (tests trace where two paths part; never inside a CUDA graph)."""
        backend, batch = self.backend, token_ids.shape[0]
        prepare, layer, head = self.functions(batch)
        specs = self.layer_specs[self.uses_gemv(batch)]
        with _dynamo_limits():
            x, h, cos, sin, write_slots, *views = prepare(
                token_ids, positions, rows, backend.page_of, backend.embed, backend.inv_freq,
                backend.layers[0].input_norm, self.kind_layers[False], self.kind_layers[True], self.step_spec)
            for i in range(self.config.num_hidden_layers):
                if residuals is not None:
                    residuals.append(x.clone())
                x, h = layer(x, h, self.layer_weights[i], backend.kv_pool, cos, sin, write_slots[i],
                             self._layer_view(views, i), self.next_norms[i], backend.decoder.expert_range, specs[i])
            if residuals is not None:
                residuals.append(x.clone())
            return head(h, backend.lm_head, self.step_spec)

    def _layer_view(self, views: list, i: int) -> tuple:
        indices, num_blocks, first_page, first_offset, last_page, last_offset = views[self.config.window(i) is not None]
        j = self.position_in_kind[i]
        return indices[j], num_blocks, first_page[j], first_offset, last_page[j], last_offset

    def compile_bucket(self, batch: int) -> float:
        """Compile the step of a batch bucket (its first call, on the scratch row) and check it against the
        eager step; the seconds it took. Raises what the compile raised, or CompileCheckError."""
        import time

        backend, device = self.backend, self.backend.device
        start = time.perf_counter()
        token_ids = torch.ones(batch, dtype=torch.long, device=device)  # one token: the rows write one slot alike
        positions = torch.zeros(batch, dtype=torch.long, device=device)
        rows = torch.full((batch,), backend.max_batch, dtype=torch.long, device=device)  # the scratch row
        with torch.inference_mode():
            self(token_ids, positions, rows)
            self.check(token_ids, positions, rows)
            if device.type == "cuda":
                self.check_memory(token_ids, positions, rows)
        self.ready[batch] = time.perf_counter() - start
        return self.ready[batch]

    def check_memory(self, token_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """CompileCheckError if a step allocates as much as half the KV pool: the pool was copied, not written and
        read in place (a K/V write inductor left functional, as once happened; on a GPU only: torch 2.13's CPU flex
        template copies K and V, the views of one buffer, whatever the write)."""
        device, pool_bytes = self.backend.device, self.backend.kv_pool.nbytes
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        self(token_ids, positions, rows)
        torch.cuda.synchronize(device)
        extra = torch.cuda.max_memory_allocated(device) - before
        if extra > max(pool_bytes // 2, MEMORY_SLACK_BYTES):
            raise CompileCheckError(f"a compiled step allocates {extra / 1e6:.0f} MB next to a KV pool of "
                                    f"{pool_bytes / 1e6:.0f} MB: it copies the pool instead of reading it in place")

    def check(self, token_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """CompileCheckError when a compiled layer or the LM head disagrees with the eager step (agreement)
        below the cosine bounds, or gives a non-finite value. A guard against a miscompiled step (wrong
        layout, garbage), not a rounding test: the tests bound the rounding."""
        for part, cos, _ in self.agreement(token_ids, positions, rows):
            bound = CHECK_LOGITS_COS_MIN if part == "LM head" else CHECK_LAYER_COS_MIN
            if not cos >= bound:  # NaN fails too
                raise CompileCheckError(f"compiled {part} disagrees with the eager step: cosine {cos:.4f} < {bound}")

    def agreement(self, token_ids: torch.Tensor, positions: torch.Tensor,
                  rows: torch.Tensor) -> list[tuple[str, float, float]]:
        """Each compiled layer against DecodeStep.layer on the same input (teacher-forced: the eager output
        is fed on), then the LM head: (part, min cosine over rows, max |got - want| / |want| over rows) of
        what each adds to the residual stream (NaN cosine if anything is not finite). Writes the new
        tokens' K/V, as a step does."""
        backend, decoder, batch = self.backend, self.backend.decoder, token_ids.shape[0]
        prepare, layer, head = self.functions(batch)
        specs = self.layer_specs[self.uses_gemv(batch)]
        step = decoder.prepare(positions, rows, -(-(int(positions.max()) + 1) // backend.page_size))
        parts = []
        with _dynamo_limits():
            x, _, cos, sin, write_slots, *views = prepare(
                token_ids, positions, rows, backend.page_of, backend.embed, backend.inv_freq,
                backend.layers[0].input_norm, self.kind_layers[False], self.kind_layers[True], self.step_spec)
            for i, layer_weights in enumerate(backend.layers):
                want = (decoder.layer(i, x.clone(), step) - x).float()
                h = backend.norm(x, layer_weights.input_norm)
                got = (layer(x, h, self.layer_weights[i], backend.kv_pool, cos, sin, write_slots[i],
                             self._layer_view(views, i), self.next_norms[i], decoder.expert_range, specs[i])[0]
                       - x).float()
                parts.append((f"layer {i}", *_closeness(got, want)))
                x = x + want.to(x.dtype)
            logits = head(backend.norm(x, backend.final_norm), backend.lm_head, self.step_spec)
            parts.append(("LM head", *_closeness(logits, backend.logits(x))))
        return parts


def _closeness(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(min cosine over rows, max relative error over rows) of got, want [B, N]; NaN cosine if got is not finite."""
    if not torch.isfinite(got).all().item():
        return float("nan"), float("inf")
    cos = F.cosine_similarity(got, want, dim=-1).min().item()
    return cos, ((got - want).norm(dim=-1) / want.norm(dim=-1).clamp(min=1e-30)).max().item()
