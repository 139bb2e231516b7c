"""`northcode generate` on the tiny synthetic checkpoint, run through cli.main in this process."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

from northcode import cli, paths
from northcode.commands.generate import generate_tokens
from northcode.model.model import NorthModel
from northcode.model.tokenizer import Tokenizer

PROMPT = "def fib(n):"


class RecordingStdout:
    """Stands in for sys.stdout and keeps every write, to see that text arrives in pieces."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    @property
    def text(self) -> str:
        return "".join(self.writes)


def run_cli(monkeypatch, capsys, *argv: str) -> tuple[int, RecordingStdout, str]:
    """(exit code, what went to stdout, stderr) of `northcode generate ARGV`."""
    stdout = RecordingStdout()
    monkeypatch.setattr(sys, "stdout", stdout)
    code = cli.main(["generate", *argv])
    return code, stdout, capsys.readouterr().err


def run_json(monkeypatch, capsys, *argv: str) -> dict:
    code, stdout, err = run_cli(monkeypatch, capsys, "--json", *argv)
    assert code == 0, err
    return json.loads(stdout.text)


def test_json_has_the_generated_ids_and_their_text(tiny_checkpoint, monkeypatch, capsys):
    result = run_json(monkeypatch, capsys, "--model", str(tiny_checkpoint), "--max-tokens", "12", PROMPT)
    assert set(result) == {"token_ids", "text"}
    ids = result["token_ids"]
    assert 1 <= len(ids) <= 12 and all(isinstance(i, int) for i in ids)
    assert result["text"] == Tokenizer.from_dir(tiny_checkpoint).decode(ids)


def test_greedy_is_the_reference_models_greedy_decode(tiny_checkpoint, monkeypatch, capsys):
    argv = ("--model", str(tiny_checkpoint), "--max-tokens", "16", "--dtype", "float32", PROMPT)
    first = run_json(monkeypatch, capsys, *argv)
    assert first == run_json(monkeypatch, capsys, *argv)
    tokenizer = Tokenizer.from_dir(tiny_checkpoint)
    prompt_ids = [tokenizer.bos_id] + tokenizer.encode(PROMPT)  # raw completion after BOS, no chat template
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where the command runs
    model = NorthModel.from_dir(tiny_checkpoint, device=device, dtype=torch.float32)
    assert first["token_ids"] == model.greedy_generate(prompt_ids, 16, stop_ids=tokenizer.eos_ids)


def test_streams_text_as_it_is_generated(tiny_checkpoint, monkeypatch, capsys):
    code, stdout, err = run_cli(monkeypatch, capsys, "--model", str(tiny_checkpoint), "--max-tokens", "16", PROMPT)
    assert code == 0, err
    pieces = [w for w in stdout.writes if w]
    assert len(pieces) > 3, f"expected text in several pieces, got {pieces!r}"
    expected = run_json(monkeypatch, capsys, "--model", str(tiny_checkpoint), "--max-tokens", "16", PROMPT)
    assert stdout.text == expected["text"] + "\n"
    assert "RANDOM WEIGHTS" in err and tiny_checkpoint.name in err  # which model, and that it is noise


def test_seeded_sampling_is_reproducible(tiny_checkpoint, monkeypatch, capsys):
    def sampled(seed: int) -> list[int]:
        return run_json(monkeypatch, capsys, "--model", str(tiny_checkpoint), "--max-tokens", "24",
                        "--temperature", "1.5", "--seed", str(seed), PROMPT)["token_ids"]

    greedy = run_json(monkeypatch, capsys, "--model", str(tiny_checkpoint), "--max-tokens", "24", PROMPT)["token_ids"]
    assert sampled(7) == sampled(7)
    assert sampled(7) != sampled(8)
    assert sampled(7) != greedy


def test_generation_stops_after_a_stop_id(tiny_checkpoint):
    model = NorthModel.from_dir(tiny_checkpoint, dtype=torch.float32)
    prompt_ids = [2, 100, 200, 300]
    free = list(generate_tokens(model, prompt_ids, 8, 0.0, torch.Generator(), stop_ids=set()))
    assert len(free) == 8
    stopped = list(generate_tokens(model, prompt_ids, 8, 0.0, torch.Generator(), stop_ids={free[2]}))
    assert stopped == free[:free.index(free[2]) + 1]


def test_without_model_uses_the_demo_checkpoint(tiny_checkpoint, monkeypatch, capsys):
    demo = paths.demo_checkpoint_dir()
    if not (demo / "config.json").is_file():  # the demo is the tiny preset, seed 0: the same files
        shutil.copytree(tiny_checkpoint, demo, dirs_exist_ok=True)
    code, stdout, err = run_cli(monkeypatch, capsys, "--max-tokens", "4", "--json", PROMPT)
    assert code == 0, err
    assert demo.name in err and "RANDOM WEIGHTS" in err
    assert len(json.loads(stdout.text)["token_ids"]) >= 1


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "float8"], "--dtype 'float8': must be one of"),
    (["--temperature", "-1"], "--temperature -1.0: must be a number >= 0"),
    (["--max-tokens", "0"], "--max-tokens 0: must be >= 1"),
    (["--model", "/nonexistent/model"], "--model /nonexistent/model: no config.json"),
])
def test_bad_options_give_a_clear_error(argv, message, monkeypatch, capsys):
    code, stdout, err = run_cli(monkeypatch, capsys, *argv, PROMPT)
    assert code == 2
    assert message in err and "Traceback" not in err
    assert stdout.text == ""


def test_bfloat16_runs_on_cpu(tiny_checkpoint, monkeypatch, capsys):
    result = run_json(monkeypatch, capsys, "--model", str(tiny_checkpoint), "--dtype", "bf16", "--max-tokens", "4",
                      PROMPT)
    assert 1 <= len(result["token_ids"]) <= 4
