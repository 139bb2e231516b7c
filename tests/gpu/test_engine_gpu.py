"""The engine on the GPU at the full North Mini Code widths, with random weights drawn on the device, at 8K
context; and the tiny checkpoint end to end with CUDA graphs.

Why two precisions: a random 49-layer MoE amplifies rounding chaotically (a bf16 near-tie in one of 48
routers picks another expert, and the change grows layer after layer), so two correct bf16 paths, or even
one path at batch 8 and at batch 1, give decorrelated logits after 49 layers. So:
- fp32, the first 5 layers of the full geometry (every layer kind), 8K tokens prefilled in chunks across the
  4096 window, then decode steps in CUDA graphs, teacher-forced: logits within FP32_MEAN_TOL of the
  reference (model.py, contiguous cache); a ragged batch of 8 equals each row alone, graphs equal eager.
- bf16, all 49 layers, decoding from the same 8K cache: each layer teacher-forced (fed the reference's
  input), its output (attention + MLP) within BF16_COS_MIN cosine and BF16_REL_TOL relative error, for
  both MoE paths (grouped GEMM, gathered weights).
And the kernel count of one decode step on CUDA (op_count.count_cuda_kernels), printed and bounded; the
bf16 step captured at batch 8 (the capture that failed on the H200); the garbage collector held off during a
capture (a dead backend's graphs destroyed inside it most likely made it fail); and a capture made to fail
on purpose: the bucket decodes eagerly and the CUDA generator still works.
Every backend here runs the eager step (compile=False); tests/gpu/test_torch_compile_gpu.py checks the compiled one.
"""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch

from northcode.engine.backend import DecodeBatch, PrefillBatch, PrefillChunk
from northcode.engine.kv_cache import KVCacheManager
from northcode.engine.sampling import BatchSamplingArgs

pytestmark = pytest.mark.gpu

CONTEXT = 8192  # tokens prefilled before the decode steps
DECODE_STEPS = 16
PREFILL_CHUNK = 2048  # the window (4096) is crossed inside the prefill: sliding pages are freed there
FP32_MEAN_TOL, FP32_COS_MIN = 1e-3, 0.99999  # mean |diff| relative to the logits' std (about 3); cosine per step
BF16_COS_MIN, BF16_REL_TOL = 0.999, 0.05  # per layer: cosine and |diff| / |reference| of its output


@pytest.fixture(scope="module")
def width5_fp32():
    """The first 5 layers of the full geometry (dense full+RoPE, 3 sliding, full NoPE), fp32 on the GPU."""
    import dataclasses

    from northcode.model.model import NorthModel
    from northcode.model.synthetic import preset_config, random_weights

    config = dataclasses.replace(preset_config("north-mini-code"), num_hidden_layers=5, layer_types=None,
                                 mlp_layer_types=None)
    weights = random_weights(config, device="cuda", dtype=torch.float32)
    return config, weights, NorthModel(config, weights)


@pytest.fixture(scope="module")
def full_model():
    from northcode.model.model import NorthModel
    from northcode.model.synthetic import preset_config, random_weights

    config = preset_config("north-mini-code")
    weights = random_weights(config, device="cuda", dtype=torch.bfloat16)
    return config, weights, NorthModel(config, weights)


def make_paged(config, weights, rows: int, pages_per_row: int):
    from northcode.torch_backend.backend import TorchBackend

    num_pages = rows * pages_per_row
    max_pages = -(-(CONTEXT + DECODE_STEPS + 64) // 64)
    kv = KVCacheManager(config, num_pages, 64, rows, max_pages)
    return kv, TorchBackend(config, weights, num_pages, 64, rows, max_pages, cuda_graphs=True, compile=False)


def paged_prefill(kv, backend, row: int, tokens: list[int]) -> torch.Tensor:
    for start in range(0, len(tokens), PREFILL_CHUNK):
        end = min(len(tokens), start + PREFILL_CHUNK)
        kv.evict_behind_window(row, start)
        kv.allocate(row, end)
        logits = backend.prefill(PrefillBatch([PrefillChunk(row, tokens[start:end], start)], kv.block_tables,
                                              kv.version, kv.high_water))
    return logits[0]


def paged_decode(kv, backend, rows: list[int], token_ids: list[int], positions: list[int]) -> torch.Tensor:
    for row, pos in zip(rows, positions):
        kv.evict_behind_window(row, pos)
        kv.allocate(row, pos + 1)
    batch = DecodeBatch(rows, token_ids, positions, BatchSamplingArgs.of_rows([]), False, True, kv.block_tables,
                        kv.version, kv.high_water)
    return backend.decode(batch).logits


def assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """got, want: [steps, V]: mean |difference| under FP32_MEAN_TOL x the logits' std, cosine of every
    step's logits at least FP32_COS_MIN, the same argmax."""
    want, got = want.float(), got.float()
    spread = want.std().item()
    diff = (got - want).abs()
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    report = (f"mean |diff| {diff.mean().item():.2e} (tol {FP32_MEAN_TOL * spread:.2e}), max {diff.max().item():.2e}, "
              f"min cosine {cos.min().item():.7f}")
    print(report)
    assert diff.mean().item() <= FP32_MEAN_TOL * spread, report
    assert cos.min().item() >= FP32_COS_MIN, report
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist(), report


def copy_into_pages(kv, backend, row: int, cache, length: int) -> None:
    """Map pages for positions 0..length-1 of a row (sliding layers only the window's) and fill them with
    the contiguous cache's K/V: both paths then decode from exactly the same state."""
    kv.allocate(row, length)
    kv.evict_behind_window(row, length)
    for layer in range(kv.num_layers):
        pages = torch.tensor(kv.tables[layer][row][:kv.num_mapped[row]], device="cuda")
        held = (pages >= 0).nonzero().flatten()
        for pool, stored in ((backend.k_pool, cache.keys[layer]), (backend.v_pool, cache.values[layer])):
            padded = torch.zeros(kv.num_mapped[row] * 64, *stored.shape[2:], dtype=stored.dtype, device="cuda")
            padded[:length] = stored[0, :length]
            pool[pages[held]] = padded.view(-1, 64, *stored.shape[2:])[held]


def test_fp32_chunked_paged_prefill_and_graph_decode_match_the_reference_at_8k(width5_fp32):
    config, weights, model = width5_fp32
    tokens = torch.randint(0, config.vocab_size, (CONTEXT + DECODE_STEPS,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = model.new_cache()
    want = [model.prefill(tokens[:CONTEXT], cache, last_only=True)[-1]]
    for pos in range(CONTEXT, CONTEXT + DECODE_STEPS - 1):
        want.append(model.decode(tokens[pos], cache))
    del cache
    kv, backend = make_paged(config, weights, rows=1, pages_per_row=5 * 132)
    got = [paged_prefill(kv, backend, 0, tokens[:CONTEXT])]
    for pos in range(CONTEXT, CONTEXT + DECODE_STEPS - 1):
        got.append(paged_decode(kv, backend, [0], [tokens[pos]], [pos])[0])
    assert_logits_close(torch.stack(got), torch.stack(want))
    sliding_held = (kv.block_tables[1, 0] >= 0).sum().item()
    assert sliding_held <= 4096 // 64 + 2  # the window's pages and one of slack, not the whole context
    assert backend.graphs, "the decode steps ran in CUDA graphs"


def test_fp32_ragged_batch_of_eight_equals_each_row_alone_and_graphs_equal_eager(width5_fp32):
    config, weights, model = width5_fp32
    tokens = torch.randint(0, config.vocab_size, (CONTEXT + 1,), generator=torch.Generator().manual_seed(2)).tolist()
    cache = model.new_cache()
    model.prefill(tokens[:CONTEXT], cache, last_only=True)
    lengths = [CONTEXT, 6000, 4097, 4000, 2500, 700, 65, 3]
    kv, backend = make_paged(config, weights, rows=8, pages_per_row=5 * 132)
    for row, length in enumerate(lengths):
        copy_into_pages(kv, backend, row, cache, length)
    rows, next_tokens = list(range(8)), [tokens[n] for n in lengths]
    together = paged_decode(kv, backend, rows, next_tokens, lengths)  # writes position `length` of each row
    alone = torch.stack([paged_decode(kv, backend, [r], [next_tokens[r]], [lengths[r]])[0] for r in rows])
    assert_logits_close(together, alone)
    backend.use_graphs = False
    try:
        assert_logits_close(paged_decode(kv, backend, rows, next_tokens, lengths), together)
    finally:
        backend.use_graphs = True


@pytest.mark.parametrize("moe_path", ["grouped", "gathered"])
def test_bf16_full_geometry_layers_match_the_reference_decoding_from_the_same_8k_cache(full_model, moe_path):
    """All 49 layers, bf16, at position 8192 of a cache the reference prefilled: each layer of the decode
    step (decode_step.py) is fed the reference's input, and its output (x_out - x_in) must match the
    reference's within the bf16 tolerance; for both MoE paths of routed_experts.py."""
    from northcode.model.model import mlp, norm, rope_cos_sin

    config, weights, model = full_model
    tokens = torch.randint(0, config.vocab_size, (CONTEXT + 1,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = model.new_cache()
    model.prefill(tokens[:CONTEXT], cache, last_only=True)
    kv, backend = make_paged(config, weights, rows=1, pages_per_row=49 * 132)
    backend.moe_path = moe_path
    copy_into_pages(kv, backend, 0, cache, CONTEXT)
    kv.allocate(0, CONTEXT + 1)
    backend.device_tables.upload(kv.block_tables, kv.version)
    rows = torch.tensor([0], device="cuda")
    positions = torch.tensor([CONTEXT], device="cuda")
    cos, sin = rope_cos_sin(positions, model.inv_freq, model.dtype)  # [1, D]: the reference's
    step = backend.decoder
    shared = step.prepare(positions, rows, -(-(CONTEXT + 1) // 64))
    x = torch.nn.functional.embedding(torch.tensor([tokens[CONTEXT]], device="cuda"), model.embed)  # [1, H]
    worst_cos, worst_rel = 1.0, 0.0
    with torch.inference_mode():
        for i, layer in enumerate(model.layers):
            h = norm(x[None], layer.input_norm, config)  # [1, 1, H]
            want = model._attention(i, layer, h, positions, cos, sin, cache)[0] + mlp(h[0], layer, config, i)
            got = step.layer(i, x.clone(), shared) - x
            want, got = want.float().flatten(), got.float().flatten()
            worst_cos = min(worst_cos, torch.nn.functional.cosine_similarity(got, want, dim=0).item())
            worst_rel = max(worst_rel, ((got - want).norm() / want.norm()).item())
            x = x + want.view_as(x).to(x.dtype)
    print(f"49 bf16 layers ({moe_path} MoE), teacher-forced at position {CONTEXT}: "
          f"min cosine {worst_cos:.5f}, max rel err {worst_rel:.4f}")
    assert worst_cos >= BF16_COS_MIN and worst_rel <= BF16_REL_TOL


def test_bf16_full_geometry_step_captures_at_batch_8_and_replays_the_eager_step(full_model):
    """All 49 bf16 layers, grouped-GEMM MoE, 8 rows of different lengths: the graph of batch 8 is captured
    (no capture failure) and its replay gives the eager step's logits on the same pages."""
    config, weights, _ = full_model
    kv, backend = make_paged(config, weights, rows=8, pages_per_row=49 * 4)
    gen = torch.Generator().manual_seed(3)
    lengths = [130, 64, 1, 77, 200, 9, 150, 33]
    prompts = [torch.randint(0, config.vocab_size, (n + 1,), generator=gen).tolist() for n in lengths]
    for row, prompt in enumerate(prompts):
        paged_prefill(kv, backend, row, prompt[:-1])
    rows = list(range(8))
    graphed = paged_decode(kv, backend, rows, [p[-1] for p in prompts], lengths)
    assert list(backend.graphs) == [(8, 4)] and not backend.capture_failures
    step = backend.graphs[(8, 4)]
    with torch.inference_mode():
        eager = backend.decode_step(step.token_ids, step.positions, step.rows, 4)  # the graph's inputs, eagerly
    cos = torch.nn.functional.cosine_similarity(graphed.float(), eager.float(), dim=-1)
    print(f"batch 8 bf16 graph vs eager: min cosine {cos.min().item():.6f}")
    assert torch.isfinite(graphed).all() and cos.min().item() >= 0.99


def test_a_backend_dropped_during_a_capture_is_not_collected_inside_it(tiny_checkpoint):
    """Backends live in reference cycles, so a dropped one and its graphs are freed whenever the garbage
    collector runs, and a graph destroyed inside another's capture invalidates that capture (most likely what
    failed the batch-8 capture on the H200). The collector is held off during a capture: a backend dropped
    inside one survives it, with the collector set to run at almost every allocation, and every capture
    succeeds; the collector runs again afterwards."""
    import weakref

    from northcode.model.checkpoint import load_checkpoint
    from northcode.torch_backend.backend import TorchBackend

    config, weights = load_checkpoint(tiny_checkpoint, device=torch.device("cuda"), dtype=torch.float32)
    first = TorchBackend(config, weights, 64, 16, 4, 16, compile=False)
    first.warm_up()
    dead, holder = weakref.ref(first), [first]
    del first
    second = TorchBackend(config, weights, 64, 16, 4, 16, compile=False)
    real_step, seen = second.decode_step, []

    def dropping_step(*args):
        if not torch.cuda.is_current_stream_capturing():
            return real_step(*args)
        holder.clear()  # the first backend is cyclic garbage from here on
        logits = real_step(*args)
        seen.append((gc.isenabled(), dead() is not None))
        return logits

    second.decode_step = dropping_step
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        second.warm_up()
    finally:
        gc.set_threshold(*thresholds)
    assert seen[0] == (False, True) and not any(enabled for enabled, _ in seen) and gc.isenabled()
    assert len(second.graphs) == 3 and not second.capture_failures
    gc.collect()
    assert dead() is None


def test_a_failed_capture_decodes_eagerly_and_leaves_the_cuda_generator_usable(tiny_checkpoint):
    from northcode.model.checkpoint import load_checkpoint
    from northcode.torch_backend.backend import TorchBackend

    config, weights = load_checkpoint(tiny_checkpoint, device=torch.device("cuda"), dtype=torch.float32)
    tokens = torch.randint(0, config.vocab_size, (30,), generator=torch.Generator().manual_seed(7)).tolist()

    def decoded(backend) -> torch.Tensor:
        kv = KVCacheManager(config, 64, 16, 4, 16)
        kv.allocate(0, 29)
        backend.prefill(PrefillBatch([PrefillChunk(0, tokens[:29], 0)], kv.block_tables, kv.version, kv.high_water))
        kv.allocate(0, 30)
        return backend.decode(DecodeBatch([0], [tokens[29]], [29], BatchSamplingArgs.of_rows([]), False, True,
                                          kv.block_tables, kv.version, kv.high_water)).logits

    broken = TorchBackend(config, weights, 64, 16, 4, 16, compile=False)
    real_step = broken.decode_step

    def syncing_step(*args):  # a host sync inside the capture: the capture fails, eager steps do not
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()
        return real_step(*args)

    broken.decode_step = syncing_step
    got = decoded(broken)
    assert not broken.graphs and list(broken.capture_failures) == [(1, 4)]
    print("capture failure recorded:", broken.capture_failures[(1, 4)])
    assert torch.isfinite(torch.randn(4, device="cuda")).all()  # the generator is not left capturing
    want = decoded(TorchBackend(config, weights, 64, 16, 4, 16, cuda_graphs=False))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_decode_step_launches_few_kernels_on_the_gpu():
    """The decode step of the full layer plan (tiny widths, bf16) counted on CUDA by torch.profiler: the
    CPU count (op_count.py) predicts it; a few more for multi-kernel ops (sort, top-k, grouped GEMM)."""
    from northcode.torch_backend.op_count import count_cuda_kernels

    for batch in (1, 8):
        total, by_part = count_cuda_kernels(batch=batch, context=8192)
        print(f"batch {batch}: {total} CUDA kernels per decode step; {dict(by_part)}")
        assert total <= {1: 1700, 8: 2100}[batch]  # measured on the H200 (2026-11-29): 1545 and 1920


def test_tiny_engine_on_the_gpu_matches_the_reference_and_reuses_prefixes(tiny_checkpoint):
    from northcode.engine.request import SamplingParams
    from northcode.engine.settings import EngineSettings
    from northcode.model.model import NorthModel
    from northcode.runtime import load_engine

    reference = NorthModel.from_dir(tiny_checkpoint, device="cuda", dtype=torch.float32)
    engine = load_engine(tiny_checkpoint, EngineSettings(device="cuda", dtype="float32", page_size=16, chunk_size=24,
                                                         num_pages=80, seed=0, compile=False))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [torch.randint(20, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 30, 61, 90)]

    async def run_all(batch):
        async def one(i, prompt):
            return [o async for o in engine.generate(f"r{i}-{len(prompt)}-{id(batch)}", prompt, params)]
        return await asyncio.gather(*[one(i, p) for i, p in enumerate(batch)])

    try:
        first = asyncio.run(run_all(prompts))  # 80 pages: too few for all four at once, preemption
        again = asyncio.run(run_all(prompts))  # the prompts come back from the prefix cache
        for prompt, outs, outs_again in zip(prompts, first, again):
            generated = [t for o in outs for t in o.token_ids]
            assert generated == [t for o in outs_again for t in o.token_ids]
            logits = reference.forward(torch.tensor([prompt + generated], device="cuda"))[0, len(prompt) - 1:-1]
            assert logits.argmax(-1).tolist() == generated
        assert sum(outs[-1].usage.cached_tokens for outs in again) >= 80  # e.g. the 90-token prompt's 5 blocks
        assert engine.scheduler.num_preemptions > 0
        assert engine.stats()["pages_used"] == 0
        assert engine.backend.graphs
    finally:
        engine.shutdown()
