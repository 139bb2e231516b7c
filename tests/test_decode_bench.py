"""`northcode bench decode`'s report on the CPU: the table and the speed-ups from a run's cells, and the torch
cells saying when they did not time the backend's best step (the compiled, graphed one): torch.compile failures at
32K and 128K once fell back to the eager step without a word, and the table's speed-ups (2.3-2.9x there, 1.3-1.8x
elsewhere) read as if against the same baseline."""

from northcode.bench.decode_bench import add_speedups, format_row, table, torch_backend_notes


def _cell(backend: str, ms: float, note: str | None = None) -> dict:
    return dict(backend=backend, batch=1, context=8192, ms_per_step=ms, tokens_per_s=1000 / ms, profile=None, note=note,
                gb_per_step=7.13, experts_per_layer=8.0, sol_datasheet=0.5, sol_measured=0.58)


def test_the_table_has_a_row_a_cell_and_the_megakernel_speedup():
    results = [_cell("megakernel", 2.966), _cell("torch", 3.975, "eager step, torch.compile failed: X")]
    add_speedups(results)
    assert round(results[0]["speedup_vs_torch"], 2) == 1.34 and results[1]["speedup_vs_torch"] is None
    lines = table(results).splitlines()
    assert lines[0].startswith("| backend | batch | context | ms/step |") and len(lines) == 5
    assert lines[2] == "| megakernel | 1 | 8192 | 2.966 | 337.2 | 7.13 | 8.0 | 50.0 | 58.0 | 1.34x |"
    assert lines[4] == "torch B=1 ctx=8192: eager step, torch.compile failed: X"
    assert "2.966 ms" in format_row(results[0]) and format_row(results[0]).endswith("1.34x")


def test_best_step_has_no_note():
    assert torch_backend_notes(None, {}) == []


def test_failed_compile_is_named():
    notes = torch_backend_notes("InductorError: SubprocException: An exception occurred in a subprocess:", {})
    assert notes == ["eager step, torch.compile failed: InductorError: SubprocException: An exception occurred in a "
                     "subprocess:"]


def test_failed_captures_follow_the_compile():
    notes = torch_backend_notes("RuntimeError: x", {(4, 130): "RuntimeError: capture", (8, 16): "OOM"})
    assert notes == ["eager step, torch.compile failed: RuntimeError: x",
                     "eager, capture failed: batch 4, 130 pages: RuntimeError: capture",
                     "eager, capture failed: batch 8, 16 pages: OOM"]
