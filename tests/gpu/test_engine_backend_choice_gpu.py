"""On the H200: `backend = megakernel` (what auto picks once MEGAKERNEL_VALIDATED) runs the tiny bf16 checkpoint, the engine serves a
batch through it, pipelined (launch_decode), and a failed step rebuilds the megakernel backend (kernel library,
scratch, pools) and goes on, pipelined again. Numerics are checked elsewhere (test_megakernel_decode.py,
test_megakernel_backend.py, test_megakernel_backend_gpu.py); this checks the engine plumbing around the
chosen backend."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_auto_runs_the_megakernel_in_the_engine_and_restarts_it(tiny_checkpoint):
    from northcode.engine.request import SamplingParams
    from northcode.engine.settings import EngineSettings
    from northcode.runtime import load_engine

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the megakernel runs on sm_90 only")
    engine = load_engine(tiny_checkpoint, EngineSettings(device="cuda", num_pages=256, seed=0, backend="megakernel"))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [torch.randint(20, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (3, 17, 40, 65, 70, 99, 130, 150)]

    async def run_all(tag: str):
        async def one(i, prompt):
            return [o async for o in engine.generate(f"{tag}-{i}", prompt, params)]
        return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])

    try:
        stats = engine.stats()
        assert stats["backend"] == "megakernel" and engine.backend.name == "megakernel", stats["backend_reason"]
        assert engine._pipelined()  # greedy requests: step n+1 is launched before step n is read
        first = asyncio.run(run_all("a"))
        assert all(outs[-1].finish_reason == "length" and sum(len(o.token_ids) for o in outs) == 24 for outs in first)
        backend = engine.backend
        real_step = backend.launch_step  # the model step of decode and launch_decode

        def broken(batch, inputs, want_logits):
            backend.launch_step = real_step  # fail once
            raise RuntimeError("megakernel: step failed: injected")

        backend.launch_step = broken
        failed = asyncio.run(run_all("b"))
        assert any(outs[-1].finish_reason == "error" and "injected" in outs[-1].error for outs in failed)
        for _ in range(3000):  # the errors go out before the backend is rebuilt
            if engine.stats()["restarts"] == 1:
                break
            asyncio.run(asyncio.sleep(0.01))
        assert engine.stats()["restarts"] == 1 and engine.backend.name == "megakernel" and engine._pipelined()
        again = asyncio.run(run_all("c"))
        assert all(outs[-1].finish_reason == "length" for outs in again)
        assert engine.stats()["pages_used"] == 0 and engine.stats()["fatal_error"] is None
    finally:
        engine.shutdown()
