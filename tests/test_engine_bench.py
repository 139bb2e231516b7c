"""`northcode bench engine` on the demo (tiny) checkpoint: it runs in seconds and reports sane figures."""

from __future__ import annotations

import json

from northcode.cli import main


def test_bench_engine_json_on_the_tiny_checkpoint(capsys):
    code = main(["bench", "engine", "--json", "--device", "cpu", "--batch-sizes", "1,2", "--prompt-len", "70",
                 "--turn-len", "8", "--context", "40", "--decode-tokens", "5", "--num-pages", "1024"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["prompt_len"] == 70 and result["ttft_cold_s"] > 0 and result["prefill_tokens_per_s"] > 0
    assert result["warm_cached_tokens"] == 64  # the cold prompt's one full page, found again
    assert [row["batch"] for row in result["decode"]] == [1, 2]
    assert all(row["tokens_per_s"] > 0 for row in result["decode"])
    assert result["backend"] == "torch"  # --backend auto on the CPU, and the engine's reason for it
    assert result["backend_reason"] == "auto: the model runs on the CPU, and the megakernel needs a CUDA GPU"


def test_bench_engine_table_names_the_backend_and_why(capsys):
    code = main(["bench", "engine", "--preset", "tiny", "--device", "cpu", "--backend", "torch", "--batch-sizes", "1",
                 "--prompt-len", "20", "--turn-len", "4", "--context", "12", "--decode-tokens", "3", "--num-pages", "1024"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("torch backend") and lines[1] == "  (asked for (backend = torch))"


def test_bench_engine_rejects_bad_options(capsys):
    assert main(["bench", "engine", "--batch-sizes", "1,x"]) == 2
    assert "--batch-sizes" in capsys.readouterr().err
    assert main(["bench", "engine", "--context", "0"]) == 2


LONG_SCHEMA = '{"type": "array", "items": {"type": "integer"}, "minItems": 64}'


def test_bench_engine_schema_measures_each_batch_constrained_and_unconstrained(capsys):
    code = main(["bench", "engine", "--preset", "tiny", "--device", "cpu", "--json", "--batch-sizes", "1,2",
                 "--prompt-len", "20", "--turn-len", "4", "--context", "40", "--decode-tokens", "12",
                 "--num-pages", "1024", "--schema", LONG_SCHEMA])
    assert code == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["schema"] == json.loads(LONG_SCHEMA) and result["decode_tokens"] == 12
    for row in result["decode"]:
        assert row["constrained_tokens_per_s"] > 0 and row["constrained_ms_per_step"] > 0
        assert row["constrained_ratio"] == row["constrained_tokens_per_s"] / row["tokens_per_s"]
        assert row["constrained_min_tokens"] == 12  # 64 items cannot close within 12 tokens
    assert "note:" not in captured.err


def test_bench_engine_schema_from_a_file_in_the_table_and_a_short_grammar_noted(capsys, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "boolean"}')
    code = main(["bench", "engine", "--preset", "tiny", "--device", "cpu", "--batch-sizes", "1", "--prompt-len", "20",
                 "--turn-len", "4", "--context", "40", "--decode-tokens", "8", "--num-pages", "1024",
                 "--schema", f"@{schema}"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[6].endswith("constrained tokens/s   ratio")
    assert lines[-1].startswith("  note: batch 1: a constrained request ended after ") and "of 8 tokens" in lines[-1]


def test_bench_engine_rejects_bad_schemas(capsys, tmp_path):
    assert main(["bench", "engine", "--schema", "{not json"]) == 2
    assert "--schema: not valid JSON" in capsys.readouterr().err
    assert main(["bench", "engine", "--schema", f"@{tmp_path / 'missing.json'}"]) == 2
    assert "cannot read the file" in capsys.readouterr().err
    assert main(["bench", "engine", "--schema", '{"type": "strin"}']) == 2
    assert "this JSON schema cannot be enforced" in capsys.readouterr().err
