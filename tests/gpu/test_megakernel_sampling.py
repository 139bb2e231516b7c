"""The megakernel's device sampling (LM head + SAMPLE tasks) against the PyTorch sampler's distribution.

For each setting, every row gets the same logits and its own seed; over many draws the token counts must
fit the distribution sampling.filter_probs gives on the kernel's own logits (fp64): a chi-square
goodness-of-fit test (bins with expected count < 5 merged) with p-value above P_MIN, so a correct
sampler fails one setting with probability P_MIN; and no draw may land on a token the filters removed.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

DRAWS = 1500  # launches per setting, 8 rows each: 12000 samples
P_MIN = 1e-4


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    order = expected.argsort(descending=True)
    big = expected[order] >= 5
    obs = torch.cat([counts[order][big], counts[order][~big].sum()[None]])
    exp = torch.cat([expected[order][big], expected[order][~big].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = max(int(keep.sum()) - 1, 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def draw(kernel, config, settings: dict, seeds: list[int], step: int) -> list[int]:
    from northcode.megakernel.kernel import RowSpec, TaskType, flatten, make_task, place_waves

    tiles = -(-config.vocab_size // 32)
    lm = [make_task(TaskType.LM_HEAD, 0, (t, 1, t), (), 0) for t in range(tiles)]
    sample = [make_task(TaskType.SAMPLE, 0, (b, tiles), ((0, tiles),)) for b in range(len(seeds))]
    kernel.set_rows([RowSpec(position=0, seq=0, step=step, seed=seed, **settings) for seed in seeds])
    kernel.launch(flatten(place_waves([lm, sample], kernel.num_blocks), 1, tiles), len(seeds))
    return kernel.tokens[:len(seeds)].tolist()


SETTINGS = [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9), dict(temperature=1.3, top_k=20),
            dict(temperature=1.0, min_p=0.05), dict(temperature=0.7, top_k=50, top_p=0.8, min_p=0.02)]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_token_frequencies_match_the_torch_sampler(settings: dict) -> None:
    from northcode.engine.sampling import filter_probs
    from test_megakernel_tasks import env, randn_bf16  # tests/gpu is on sys.path (rootdir-less test modules)

    config, weights, model, cache, kernel = env()
    kernel.h.copy_(randn_bf16(1, config.hidden_size).expand(8, -1).contiguous())  # same logits on every row
    counts = torch.zeros(config.vocab_size, dtype=torch.float64)
    for n in range(DRAWS):
        for token in draw(kernel, config, settings, [1000 + 8 * n + b for b in range(8)], step=n % 7):
            counts[token] += 1
    kernel.check()
    logits = kernel.logits[0].double().cpu()
    probs = torch.softmax(logits / settings["temperature"], dim=-1)[None]
    probs = filter_probs(probs, torch.tensor([settings.get("top_k", 0)]),
                         torch.tensor([settings.get("top_p", 1.0)], dtype=torch.float64),
                         torch.tensor([settings.get("min_p", 0.0)], dtype=torch.float64))[0]
    removed = probs == 0
    assert counts[removed].sum() == 0, f"{int(counts[removed].sum())} draws of filtered-out tokens"
    p_value = chi_square_p_value(counts, probs)
    assert p_value > P_MIN, f"chi-square p = {p_value:.2e}"


def test_seeded_draws_do_not_depend_on_the_batch_position() -> None:
    from test_megakernel_tasks import env, randn_bf16  # tests/gpu is on sys.path (rootdir-less test modules)

    config, weights, model, cache, kernel = env()
    kernel.h.copy_(randn_bf16(1, config.hidden_size).expand(8, -1).contiguous())
    seeds = [11, 22, 33, 44, 55, 66, 77, 88]
    first = draw(kernel, config, dict(temperature=1.0, top_p=0.95), seeds, step=5)
    second = draw(kernel, config, dict(temperature=1.0, top_p=0.95), seeds[::-1], step=5)
    assert second == first[::-1]
    fast = draw(kernel, config, dict(temperature=1.0), seeds, step=5)
    assert fast == draw(kernel, config, dict(temperature=1.0), seeds, step=5)
