"""`northcode bench decode`'s torch cells say when they did not time the backend's best step (the compiled,
graphed one): run 99's torch.compile failures at 32K and 128K fell back to the eager step without a word, and the
table's speed-ups (2.3-2.9x there, 1.3-1.8x elsewhere) read as if against the same baseline."""

from northcode.bench.decode_bench import torch_backend_notes


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
