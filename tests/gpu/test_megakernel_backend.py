"""MegakernelBackend (backend.py's protocol) against TorchBackend on the tiny geometry: prompts prefilled by
each (the megakernel backend hands prefill to its own TorchBackend), then one decode step. The per-step
numerics are checked exactly in test_megakernel_decode.py; this checks the plumbing: block tables,
rows, positions, batches above 8 rows split into launches, logits and device-sampled tokens."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_backend_matches_the_torch_backend() -> None:
    from northcode.engine.backend import DecodeBatch, PrefillBatch, PrefillChunk
    from northcode.engine.request import SamplingParams
    from northcode.engine.sampling import BatchSamplingArgs, SamplingRow
    from northcode.megakernel.backend import MegakernelBackend
    from northcode.model.synthetic import preset_config, random_weights
    from northcode.torch_backend.backend import TorchBackend

    config = preset_config("tiny", 1003)
    weights = random_weights(config, device="cuda", dtype=torch.bfloat16, seed=2)
    rows, pages_per_seq, page = 10, 4, 64
    tables = torch.full((config.num_hidden_layers, rows, pages_per_seq), -1, dtype=torch.int32)
    tables[:] = torch.arange(config.num_hidden_layers * rows * pages_per_seq, dtype=torch.int32).view(tables.shape)
    num_pages = tables.numel()
    lengths = [3 + 17 * r for r in range(rows)]  # 3..156 tokens: crosses pages and the window of 32
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in lengths]
    backends = [TorchBackend(config, weights, num_pages, page, rows, pages_per_seq, cuda_graphs=False),
                MegakernelBackend(config, weights, num_pages, page, rows, pages_per_seq)]
    results = []
    for backend in backends:
        backend.prefill(PrefillBatch([PrefillChunk(r, prompts[r], 0) for r in range(rows)], tables, 1))
        sampling = [SamplingRow(SamplingParams(temperature=0.0), seed=r, prompt_ids=prompts[r], output_ids=[])
                    for r in range(rows)]
        batch = DecodeBatch(list(range(rows)), [p[-1] for p in prompts], lengths, BatchSamplingArgs.of_rows(sampling),
                            sample=backend.name == "megakernel", return_logits=True, block_tables=tables,
                            tables_version=1)
        results.append(backend.decode(batch))
    ref, got = results[0].logits, results[1].logits
    cos = torch.nn.functional.cosine_similarity(ref, got, dim=-1)
    assert cos.median() >= 0.999 and cos.min() >= 0.9, cos.tolist()  # a router near-tie may flip one row
    assert results[1].token_ids == got.argmax(-1).tolist()
    assert SamplingParams(temperature=0.7, top_p=0.9).is_device_sampled  # what the megakernel samples
    assert not SamplingParams(repetition_penalty=1.2).is_device_sampled
