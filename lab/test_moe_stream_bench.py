"""CPU: lab/moe_stream_bench.py parses its arguments and refuses an expert count the layer does not have before it
touches a GPU."""

from __future__ import annotations

import argparse

import pytest

import moe_stream_bench


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    moe_stream_bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_cover_batch_one_and_every_expert() -> None:
    args = _args()
    assert args.experts == [8, 32, 128] and args.repeats > 0


@pytest.mark.parametrize("count", ["0", "129"])
def test_an_expert_count_the_layer_lacks_is_refused(count: str) -> None:
    with pytest.raises(SystemExit, match="--experts: each count must be 1..128"):
        moe_stream_bench.run(_args("--experts", "8", count))
