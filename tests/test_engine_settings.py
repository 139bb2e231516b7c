"""EngineSettings' thread count (issue 24, point 7): torch's CPU pool is sized once at engine start, from
num_threads, else OMP_NUM_THREADS, else half the cores (at most 4), never one per core by default; the same
rule sizes `northcode generate`, and `--threads` sets it for generate and serve."""

from __future__ import annotations

import pytest
import torch

from northcode import cli
from northcode.engine import settings as settings_module
from northcode.engine.settings import EngineSettings, cpu_threads
from tests.test_engine import greedy, make_engine, prompt_of, run, tokens_of


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_the_default_is_omp_num_threads_else_half_the_cores_at_most_four(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads(None) == 3 and cpu_threads(2) == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "not a number")
    for cores, expected in [(1, 1), (2, 1), (3, 1), (6, 3), (8, 4), (128, 4)]:
        monkeypatch.setattr(settings_module.os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert cpu_threads(None) == expected, cores
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert cpu_threads(None) == 4


def test_num_threads_is_validated():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="^engine setting num_threads = "):
            EngineSettings(num_threads=bad)


def test_the_engine_sets_torchs_threads_once_at_start(tiny_checkpoint, restore_threads):
    torch.set_num_threads(1)
    engine = make_engine(tiny_checkpoint, num_threads=2)
    try:
        assert torch.get_num_threads() == 2
        assert len(tokens_of(run(engine, [(prompt_of(8, salt=50), greedy(4))])[0])) == 4
    finally:
        engine.shutdown()


def test_generate_takes_threads(tiny_checkpoint, capsys, restore_threads):
    torch.set_num_threads(1)
    assert cli.main(["generate", "--model", str(tiny_checkpoint), "--max-tokens", "2", "--threads", "2",
                     "--json", "hi"]) == 0
    assert torch.get_num_threads() == 2
    assert cli.main(["generate", "--model", str(tiny_checkpoint), "--threads", "0", "hi"]) == 2
    assert "--threads 0: must be >= 1" in capsys.readouterr().err


def test_serve_passes_threads_to_the_engine_settings(capsys):
    assert cli.main(["serve", "--threads", "0"]) == 2  # refused before uvicorn starts or a weight is read
    assert "engine setting num_threads = 0" in capsys.readouterr().err
