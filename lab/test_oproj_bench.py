"""CPU: lab/oproj_bench.py's waves are what it says (o_proj tiles of the layers after the dense one, phased rounds
chained by their counters) and bad arguments stop it before it touches a GPU."""

from __future__ import annotations

import argparse

import pytest

import oproj_bench
from kernel_rig import small_config

from northcode.megakernel.tasks import TaskType, flatten, place_waves


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    oproj_bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def _config():
    return small_config(oproj_bench.LAYERS)


@pytest.mark.parametrize("mode", oproj_bench.MODES)
def test_waves_cycle_the_layers_and_chain_when_phased(mode: str) -> None:
    config, rounds = _config(), 10
    waves, counters = oproj_bench.oproj_waves(config, rounds, mode)
    tiles = config.hidden_size // 16
    oproj = [w for w in waves if isinstance(w, list)]
    moe = [w[1] for w in waves if isinstance(w, tuple)]
    assert len(oproj) == rounds and all(len(w) == tiles for w in oproj)
    for r, wave in enumerate(oproj):
        assert {t[0] for t in wave} == {int(TaskType.OPROJ)}
        assert {t[1] for t in wave} == {1 + r % (oproj_bench.LAYERS - 1)}  # never the dense layer 0
        assert sorted(t[2] for t in wave) == list(range(tiles)) and {t[3] for t in wave} == {1}
        wait, target, signal = {t[8] for t in wave}, {t[10] for t in wave}, {t[12] for t in wave}
        if mode == "phased":
            assert signal == {r} and (wait, target) == (({r - 1}, {tiles}) if r else ({-1}, {0}))
        else:
            assert wait == {-1} and signal == {-1}
    if mode == "after-moe":  # an up and a down share before each round, on the round's own slot counters
        assert [t[0] for t in moe] == [int(TaskType.MOE_UP), int(TaskType.MOE_DOWN)] * rounds
        assert [t[3] for t in moe] == [r * oproj_bench.MOE_EXPERTS for r in range(rounds) for _ in range(2)]
        assert [t[4] for t in moe[::2]] == [rounds * oproj_bench.MOE_EXPERTS + r for r in range(rounds)]  # claims
        assert counters == rounds * (oproj_bench.MOE_EXPERTS + 1)
    else:
        assert not moe and counters == rounds
    schedule = flatten(place_waves(waves, 132), counters, 0)  # one tile per SM a round
    assert schedule.tasks.shape[0] == rounds * tiles + len(moe) * 132


@pytest.mark.parametrize("argv", [("--rounds", "0"), ("--repeats", "0")])
def test_bad_counts_are_refused(argv: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit, match="at least 1"):
        oproj_bench.run(_args(*argv))


def test_defaults_are_a_steps_worth() -> None:
    args = _args()
    assert args.rounds == 49 and args.repeats > 0
