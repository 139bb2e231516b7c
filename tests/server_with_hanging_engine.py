"""`northcode serve` (the real command) whose engine's decode step hangs for good from its third one, on the CPU.

Run as `python -m tests.server_with_hanging_engine SERVE-OPTIONS` from the repository root (the fatal-error
test in test_server_openai.py). runtime.load_engine is replaced so the engine it builds has a backend
whose decode step (decode_logits: pipelined or not, the engine runs the model there) blocks forever once
HANG_AT steps were made (the step thread really stalls, as on a lost GPU), and a watchdog with short
limits: the step is given up after STEP_TIMEOUT_S, the device is declared lost HANG_GRACE_S later, and
serve must report it and exit 1 although its step thread never returns.
"""

from __future__ import annotations

import dataclasses
import sys
import threading

import torch

from northcode import runtime
from northcode.cli import main
from northcode.engine.engine import Engine
from northcode.model.checkpoint import load_checkpoint
from northcode.model.tokenizer import Tokenizer
from northcode.paths import model_display_name
from northcode.torch_backend.backend import TorchBackend

HANG_AT = 3  # decode steps of the whole process; the first two run (they warm the step's shape up)
STEP_TIMEOUT_S = 0.5
HANG_GRACE_S = 0.5
_calls = 0
_never = threading.Event()  # never set: the hung decode waits on it until the process ends


class HangingBackend(TorchBackend):
    def decode_logits(self, batch, token_ids):
        global _calls
        _calls += 1
        if _calls >= HANG_AT:
            _never.wait()
        return super().decode_logits(batch, token_ids)


def hanging_backend(config, weights, settings, num_pages, max_pages_per_seq):
    return HangingBackend(config, weights, num_pages, settings.page_size, settings.max_batch, max_pages_per_seq,
                          cuda_graphs=False)


def load_engine(model_dir, settings=None, progress=None):
    settings = dataclasses.replace(settings, step_timeout_s=STEP_TIMEOUT_S, hang_grace_s=HANG_GRACE_S)
    config, weights = load_checkpoint(model_dir, device=torch.device("cpu"), dtype=torch.float32, progress=progress)
    return Engine(config, weights, Tokenizer.from_dir(model_dir), settings, model_name=model_display_name(model_dir),
                  backend_factory=hanging_backend)


if __name__ == "__main__":
    runtime.load_engine = load_engine
    sys.exit(main(["serve", *sys.argv[1:]]))
