"""The torch.compile'd decode step on the GPU (torch_backend/compiled_step.py) against the eager step, both in
CUDA graphs: the tiny model in fp32 (logits to fp32 rounding, 24 steps across pages and the window, batch bucket
8 only: the tiny shapes check the paged views and the padded rows, not the batch-1 GEMVs), and the first 5
layers of North Mini Code in bf16 decoding from random 8K caches (each layer teacher-forced within the bf16
bounds of tests/gpu/test_engine_gpu.py; end to end, each row's residual stream and logits within them up to the
first router near-tie (trace_rows), and a step that allocates
far less than the KV pool: the pages are written and read in place), at batch 1 and 2 (inductor's GEMVs,
gathered experts read in place; row 2 crosses the window) and batch 8 (cuBLAS, grouped GEMM). Every compile must
succeed (no fallback), one graph per batch bucket serves every context, and no step after the first compiles.
Four buckets compile in all (about 20 + 60 + 65 + 20 s cold on the H200; less after the bench's compiles of the
same kernels).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from northcode.engine.backend import DecodeBatch, PrefillBatch, PrefillChunk
from northcode.engine.kv_cache import KVCacheManager
from northcode.engine.sampling import BatchSamplingArgs

pytestmark = pytest.mark.gpu
NO_SAMPLING = BatchSamplingArgs.of_rows([])  # batches that ask for logits only

BF16_COS_MIN, BF16_REL_TOL = 0.999, 0.05  # per layer, as the 49-layer bf16 test of test_engine_gpu.py
# End to end, the two paths' roundings differ, and with random weights the router's k-th/(k+1)-th gap is within
# that at every few (row, layer) pairs: one other expert moves a row's logits anywhere (cosine 0.77 was seen).
# So a row is held to BF16_COS_MIN end to end only while its routing is clear of near-ties on both paths
# (gap >= ROUTER_GAP_TOL, as bench/decode_check.py); a row with a near-tie is held to it up to that layer.
ROUTER_GAP_TOL = 0.05


def test_tiny_compiled_graph_equals_the_eager_graphs_over_pages_and_the_window(tiny_checkpoint):
    from torch._dynamo.utils import counters

    from northcode.model.checkpoint import load_checkpoint
    from northcode.torch_backend.backend import ANY_CONTEXT, TorchBackend

    config, weights = load_checkpoint(tiny_checkpoint, device=torch.device("cuda"), dtype=torch.float32)
    tokens = torch.randint(0, config.vocab_size, (160,), generator=torch.Generator().manual_seed(3)).tolist()
    lengths = [100, 70, 33, 31, 17, 16, 2, 1]
    backends, managers = [], []
    for compile in (False, True):
        kv = KVCacheManager(config, 400, 16, 8, 16)
        backend = TorchBackend(config, weights, 400, 16, 8, 16, compile=compile)
        for row, n in enumerate(lengths):
            kv.allocate(row, n)
            backend.prefill(PrefillBatch([PrefillChunk(row, tokens[:n], 0)], kv.block_tables, kv.version,
                                         kv.high_water))
        backends.append(backend)
        managers.append(kv)
    next_position = list(lengths)
    graphs = None
    for step in range(24):
        rows = list(range(8)) if step % 2 == 0 else [0, 2, 5]  # 8 rows, then 3 (bucket 4): rows 0, 2, 5 run ahead
        positions = [next_position[r] for r in rows]
        logits = []
        for kv, backend in zip(managers, backends):
            for row, pos in zip(rows, positions):
                kv.evict_behind_window(row, pos)
                kv.allocate(row, pos + 1)
            batch = DecodeBatch(rows, [tokens[p] for p in positions], positions, NO_SAMPLING, False, True, kv.block_tables,
                                kv.version, kv.high_water)
            logits.append(backend.decode(batch).logits)
        torch.testing.assert_close(logits[1], logits[0], atol=1e-3, rtol=1e-3)
        for row in rows:
            next_position[row] += 1
        if step == 1:  # both buckets (8 and 4) compiled
            graphs = counters["stats"]["unique_graphs"]
    compiled = backends[1]
    print(f"tiny fp32: compile seconds per bucket {compiled.compiled.ready}")
    assert compiled.compile_failure is None and not compiled.capture_failures
    assert set(compiled.graphs) == {(8, ANY_CONTEXT), (4, ANY_CONTEXT)}
    assert counters["stats"]["unique_graphs"] == graphs  # later steps, longer contexts: no new graph


@pytest.fixture(scope="module")
def width5_bf16():
    """The first 5 layers of the full geometry (dense full+RoPE, 3 sliding, full NoPE), bf16 on the GPU."""
    from northcode.model.synthetic import preset_config, random_weights

    config = dataclasses.replace(preset_config("north-mini-code"), num_hidden_layers=5, layer_types=None,
                                 mlp_layer_types=None)
    return config, random_weights(config, device="cuda", dtype=torch.bfloat16, seed=0)


@pytest.mark.parametrize("lengths", [[8192], [8192, 4095], [8192, 8000, 4160, 4095, 64, 63, 1, 5000]],
                         ids=["b1", "b2", "b8"])
def test_five_layers_of_north_mini_code_compiled_equal_eager_at_8k_in_place(width5_bf16, lengths):
    from northcode.bench.decode_setup import paged_cache
    from northcode.torch_backend.backend import ANY_CONTEXT, TorchBackend

    config, weights = width5_bf16
    steps = 4
    cache = paged_cache(config, lengths, steps + 2, "cuda", seed=len(lengths))
    tables = cache.block_tables.cpu()
    batch = len(lengths)
    backends = []
    for compile in (False, True):
        backend = TorchBackend(config, weights, cache.k_pool.shape[0], 64, batch, tables.shape[2], compile=compile)
        backend.k_pool[:-1].copy_(cache.k_pool)
        backend.v_pool[:-1].copy_(cache.v_pool)
        backends.append(backend)
    eager, compiled = backends
    rows = list(range(batch))
    token_ids = [1000 + 37 * b for b in rows]
    end_to_end = []  # per step, the rows' failures: asserted after the strict per-layer check below
    for step in range(steps):
        positions = [n + step for n in lengths]
        got = [b.decode(DecodeBatch(rows, token_ids, positions, NO_SAMPLING, False, True, tables, 0)).logits
               for b in backends]
        end_to_end.append(trace_rows(eager, compiled, token_ids, positions, got, f"B={batch} step {step}"))
    assert compiled.compile_failure is None and not compiled.capture_failures
    assert set(compiled.graphs) == {(batch, ANY_CONTEXT)}
    print(f"B={batch}: compile seconds {compiled.compiled.ready}")
    with torch.inference_mode():  # as decode does: inference tensors, the grad mode the graphs were compiled in
        inputs = [torch.tensor(values, device="cuda") for values in (token_ids, [n + steps for n in lengths], rows)]
        parts = compiled.compiled.agreement(*inputs)  # each layer teacher-forced at the next position
        inputs[1] += 1  # the position after: a step as the bench times it, outside the CUDA graph
        extra, pool_bytes = step_bytes(compiled.compiled, *inputs), compiled.kv_pool.nbytes
    for part, cos, rel in parts:
        print(f"B={batch} {part}: cosine {cos:.5f}, rel err {rel:.4f}")
        assert cos >= BF16_COS_MIN and rel <= BF16_REL_TOL, part
    print(f"compiled B={batch} step at 8K: {extra / 1e6:.1f} MB allocated next to a {pool_bytes / 1e6:.0f} MB pool")
    assert extra < pool_bytes / 4  # a copy of the pool (a K/V write left functional) takes all of it
    assert not any(end_to_end), end_to_end


def trace_rows(eager, compiled, token_ids: list[int], positions: list[int], graph_logits: list[torch.Tensor],
               where: str) -> list[str]:
    """Both steps again at the same positions outside their graphs, recording the residual stream after every
    layer; the failures (empty: none) of each row's end-to-end check. Prints each row's logits cosine, the first
    layer whose router is near a tie on either path (or the experts differ), and that gap."""
    cfg = eager.config
    with torch.inference_mode():
        inputs = [torch.tensor(values, device="cuda") for values in (token_ids, positions, list(range(len(positions))))]
        paths = {"eager": [], "compiled": []}
        pages = -(-(max(positions) + 1) // eager.page_size)
        logits = {"eager": eager.decoder(*inputs, pages, residuals=paths["eager"]),
                  "compiled": compiled.compiled(*inputs, residuals=paths["compiled"])}
        failures = []
        if not torch.allclose(logits["compiled"], graph_logits[1], atol=1e-3, rtol=1e-3):
            failures.append(f"{where}: the compiled graph's logits differ from its functions' outside the graph")
        ties = [None] * len(positions)  # row -> (first layer near a tie, its gap)
        for i in range(cfg.num_hidden_layers):
            if cfg.is_dense(i):
                continue
            for name in paths:  # the router on this path's input to layer i
                backend = eager if name == "eager" else compiled
                h = backend.norm(paths[name][i], backend.layers[i].input_norm)
                router = F.linear(h, backend.qkv_proj[i])[:, backend.qkv_size:].float()
                top = router.topk(cfg.num_experts_per_tok + 1, dim=-1)
                gaps = (top.values[:, -2] - top.values[:, -1]).tolist()
                chosen = top.indices[:, :-1].sort(dim=-1).values
                if name == "eager":
                    eager_chosen = chosen
                same = (chosen == eager_chosen).all(dim=-1).tolist()
                for row, (gap, agree) in enumerate(zip(gaps, same)):
                    if ties[row] is None and (gap < ROUTER_GAP_TOL or not agree):
                        ties[row] = (i, gap)
        last = cfg.num_hidden_layers
        for row in range(len(positions)):
            upto = last if ties[row] is None else ties[row][0]  # residuals 0..upto are inputs before the tie
            cos_x = [F.cosine_similarity(paths["compiled"][j][row].float(), paths["eager"][j][row].float(), dim=0).item()
                     for j in range(upto + 1)]
            cos_logits = F.cosine_similarity(graph_logits[1][row], graph_logits[0][row], dim=0).item()
            tie = "none" if ties[row] is None else f"layer {ties[row][0]} gap {ties[row][1]:.4f}"
            print(f"{where} row {row}: logits cosine {cos_logits:.5f}, first router near-tie {tie}, "
                  f"residual cosine up to it {min(cos_x):.5f}")
            if not torch.isfinite(graph_logits[1][row]).all():
                failures.append(f"{where} row {row}: logits not finite")
            if min(cos_x) < BF16_COS_MIN or (ties[row] is None and cos_logits < BF16_COS_MIN):
                failures.append(f"{where} row {row}: cosine {min(cos_x):.5f} (residuals), {cos_logits:.5f} "
                                f"(logits) with no router near-tie before ({tie})")
    return failures


def step_bytes(step, token_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> int:
    """Peak bytes a compiled step allocates (over what was allocated before it); its graphs already compiled."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(token_ids, positions, rows)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before
