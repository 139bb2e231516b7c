"""The torch.compile'd decode step (torch_backend/compiled_step.py) on the CPU: the setting, the fallback to the
eager step, the warm-up check, the K/V write in the graph inductor gets (one inductor writes in place), and
(where a C++ compiler exists: inductor's CPU code is C++) the compiled step of the tiny model against the eager
step over contexts that cross pages and the sliding window."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from northcode.engine.backend import DecodeBatch, PrefillBatch, PrefillChunk
from northcode.engine.kv_cache import KVCacheManager
from northcode.model.checkpoint import load_checkpoint
from northcode.torch_backend import compiled_step
from northcode.torch_backend.compiled_step import CompileCheckError, CompiledDecode, compile_requested
from northcode.torch_backend.backend import TorchBackend

PAGE = 16  # the tiny model's 32-token window spans two or three pages
CXX = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return load_checkpoint(tiny_checkpoint, dtype=torch.float32)


def prefilled(config, weights, lengths: list[int], tokens: list[int], compile: bool | None):
    """A backend (4 rows, no graphs on the CPU) with rows 0.. prefilled to `lengths`, and its KV manager."""
    kv = KVCacheManager(config, 200, PAGE, 4, 64)
    backend = TorchBackend(config, weights, 200, PAGE, 4, 64, compile=compile)
    for row, length in enumerate(lengths):
        kv.allocate(row, length)
        backend.prefill(PrefillBatch([PrefillChunk(row, tokens[:length], 0)], kv.block_tables, kv.version,
                                     kv.high_water))
    return kv, backend


def decode(kv, backend, tokens: list[int], positions: list[int]) -> torch.Tensor:
    rows = list(range(len(positions)))
    for row, pos in zip(rows, positions):
        kv.evict_behind_window(row, pos)
        kv.allocate(row, pos + 1)
    batch = DecodeBatch(rows, [tokens[p] for p in positions], positions, [], False, True, kv.block_tables,
                        kv.version, kv.high_water)
    return backend.decode(batch).logits


def test_compile_follows_the_argument_then_the_environment_and_is_on_for_gpu_graphs_only(tiny, monkeypatch):
    config, weights = tiny
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("NORTHCODE_TORCH_COMPILE", raising=False)
    assert not compile_requested(None, cpu)
    assert TorchBackend(config, weights, 16, PAGE, 2, 8).compiled is None
    assert compile_requested(True, cpu) and not compile_requested(False, cuda)
    assert not compile_requested(None, cuda, cuda_graphs=False)  # a prefiller or a reference: nothing to compile
    assert compile_requested(None, cuda)  # the GPU's default: the compiled step in its CUDA graph
    monkeypatch.setenv("NORTHCODE_TORCH_COMPILE", "1")
    assert compile_requested(None, cpu) and not compile_requested(False, cpu)
    assert isinstance(TorchBackend(config, weights, 16, PAGE, 2, 8).compiled, CompiledDecode)
    monkeypatch.setenv("NORTHCODE_TORCH_COMPILE", "0")
    assert not compile_requested(None, cuda)
    monkeypatch.setenv("NORTHCODE_TORCH_COMPILE", "yes")
    with pytest.raises(ValueError, match="NORTHCODE_TORCH_COMPILE"):
        compile_requested(None, cpu)


def test_a_failing_compile_warns_once_and_the_eager_step_decodes(tiny, monkeypatch, caplog):
    config, weights = tiny
    tokens = torch.randint(0, config.vocab_size, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    kv, eager = prefilled(config, weights, [40], tokens, compile=False)
    want = [decode(kv, eager, tokens, [pos])[0] for pos in (40, 41)]

    def broken(self, batch):
        raise RuntimeError("no working triton\nsecond line")

    monkeypatch.setattr(CompiledDecode, "compile_bucket", broken)
    kv, backend = prefilled(config, weights, [40], tokens, compile=True)
    with caplog.at_level(logging.WARNING, logger="northcode.torch_backend.backend"):
        got = [decode(kv, backend, tokens, [pos])[0] for pos in (40, 41)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert backend.compiled is None and backend.compile_failure == "RuntimeError: no working triton"
    assert len([r for r in caplog.records if "torch.compile" in r.getMessage()]) == 1


def test_the_warm_up_check_refuses_a_step_that_disagrees_with_the_eager_step(tiny, monkeypatch):
    """The compiled functions replaced by a wrong layer (run as plain Python, no compile): the check at
    warm-up catches it, the backend decodes with the eager step, and the result is the eager one."""
    config, weights = tiny

    def wrong_layer(x, h, *args):
        return x + 1.0, h

    monkeypatch.setattr(CompiledDecode, "functions",
                        lambda self, batch: (compiled_step.prepare_step, wrong_layer, compiled_step.head_step))
    backend = TorchBackend(config, weights, 64, PAGE, 2, 8, compile=True)
    with pytest.raises(CompileCheckError, match="layer 0"):
        backend.compiled.compile_bucket(2)
    backend.warm_up()
    assert backend.compiled is None and backend.compile_failure.startswith("CompileCheckError: compiled layer 0")


def test_every_compiled_layer_writes_the_kv_pool_itself_so_inductor_writes_it_in_place(tiny):
    """The graph inductor gets of each layer kind (recorded after AOT autograd, nothing compiled): the K/V write
    is a scatter whose target is the pool's graph input itself, and the pool input has no other reader than that
    scatter and the copy back. torch 2.11's reinplace pass (fx_passes/reinplace.py, can_inplace) keeps a scatter
    into a *view* of a graph input functional: the step then allocates a pool-sized result and copies it back,
    every layer (on the H200: 529 MB allocated next to a 527 MB pool). torch 2.13 on this CPU reinplaces
    both forms, so this graph shape, not the CPU's allocations, is what tells them apart (the CPU's flex template
    copies K and V anyway: both are views of one buffer)."""
    from functorch.compile import make_boxed_compiler
    from torch._dynamo.backends.common import aot_autograd

    config, weights = tiny
    backend = TorchBackend(config, weights, 64, PAGE, 2, 8, compile=True)
    compiled, batch = backend.compiled, 2
    graphs = []

    def record(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    recording = aot_autograd(fw_compiler=make_boxed_compiler(record), keep_inference_input_mutations=True)
    layer = torch.compile(compiled_step.layer_step, backend=recording, fullgraph=True, dynamic=False)
    positions = torch.tensor([20, 3])  # a second page and a page start
    rows = torch.tensor([0, 1])
    kv = KVCacheManager(config, 64, PAGE, 2, 8)
    for row, pos in zip(rows.tolist(), positions.tolist()):
        kv.allocate(row, pos + 1)
    backend.device_tables.upload(kv.block_tables, kv.version, kv.high_water)
    specs = compiled.layer_specs[False]
    with torch.inference_mode(), compiled_step._dynamo_limits():
        x, h, cos, sin, write_slots, *views = compiled_step.prepare_step(
            torch.ones(batch, dtype=torch.long), positions, rows, backend.page_of, backend.embed, backend.inv_freq,
            backend.layers[0].input_norm, compiled.kind_layers[False], compiled.kind_layers[True], compiled.step_spec)
        for i in range(config.num_hidden_layers):
            layer(x, h, compiled.layer_weights[i], backend.kv_pool, cos, sin, write_slots[i],
                  compiled._layer_view(views, i), compiled.next_norms[i], backend.decoder.expert_range, specs[i])
    assert len(graphs) == len(set(specs)) >= 2  # one graph per layer kind
    for graph in graphs:
        pool = [node for node in graph.graph.nodes if node.op == "placeholder"
                and tuple(node.meta["val"].shape) == tuple(backend.kv_pool.shape)]
        assert len(pool) == 1
        users = list(pool[0].users)
        writes = [user for user in users if user.target is torch.ops.aten.index_put.default]
        assert [node.target for node in users if node not in writes] == [torch.ops.aten.copy_.default], (
            f"the pool input is read by {[str(node.target) for node in users]}: the K/V write goes into a view "
            "of the pool (or the old pool is read), which torch 2.11's inductor does not do in place")
        assert len(writes) == 1 and writes[0].args[0] is pool[0]
        copy_back = next(node for node in users if node not in writes)
        assert copy_back.args == (pool[0], writes[0])


@pytest.mark.skipif(CXX is None, reason="inductor's CPU code needs a C++ compiler")
def test_the_compiled_step_equals_the_eager_step_on_the_cpu(tiny):
    """fp32, 3 rows in the bucket of 4 (one padded row), 40 steps from ragged lengths: every row crosses page
    boundaries and the 32-token window; the compiled step (one compile for the bucket, ~40 s cold on 2 cores)
    gives the eager step's logits and K/V to fp32 rounding, and no step after the first compiles anything."""
    from torch._dynamo.utils import counters

    config, weights = tiny
    tokens = torch.randint(0, config.vocab_size, (120,), generator=torch.Generator().manual_seed(5)).tolist()
    lengths = [45, 14, 1]
    kv_eager, eager = prefilled(config, weights, lengths, tokens, compile=False)
    kv, backend = prefilled(config, weights, lengths, tokens, compile=True)
    graphs = None
    for step in range(40):
        positions = [n + step for n in lengths]
        want = decode(kv_eager, eager, tokens, positions)
        torch.testing.assert_close(decode(kv, backend, tokens, positions), want, atol=1e-4, rtol=1e-4)
        graphs = graphs or counters["stats"]["unique_graphs"]  # after the first step's compile
    assert backend.compile_failure is None and list(backend.compiled.ready) == [4]
    assert counters["stats"]["unique_graphs"] == graphs  # every later context ran the same graphs
    torch.testing.assert_close(backend.kv_pool[:, :-1], eager.kv_pool[:, :-1], atol=1e-5, rtol=1e-5)


def test_compiled_pool_stays_under_32_bit_offsets_and_the_engine_caps_its_pool():
    """compiled_pool_pages: the largest pool the compiled step indexes with 32-bit offsets; the engine sizes its
    pool to it where the torch backend will compile (a 68 GB pool failed flex_attention's Triton
    compile), and not where it will not."""
    from northcode.engine.backend import BackendChoice
    from northcode.engine.kv_cache import kv_page_budget
    from northcode.engine.settings import EngineSettings
    from northcode.model.synthetic import preset_config
    from northcode.runtime import page_limit
    from northcode.torch_backend.compiled_step import compiled_pool_pages

    config = preset_config("north-mini-code")
    pages = compiled_pool_pages(config, 64)
    per_page = 2 * 64 * config.num_key_value_heads * config.head_dim
    assert (pages + 1) * per_page < 2 ** 31 <= (pages + 2) * per_page
    cpu, huge = torch.device("cpu"), 1 << 40  # a byte budget far past the cap

    def budget(backend: str, **settings) -> int:
        values = EngineSettings(cpu_kv_bytes=huge, **settings)
        return kv_page_budget(config, values, torch.float32, cpu,
                              page_limit(BackendChoice(backend, "test"), config, values, cpu))

    assert budget("torch", compile=True) == pages
    assert budget("torch", compile=False) == budget("megakernel", compile=True) > pages
