"""What an endpoint serves, as the app shows it: the model's label, whether its weights are random, its context.

Read once after connecting, from the /v1/models entry of the id requests use (server_process
names the model and spots random weights; vLLM, llama.cpp and northcode spell the context
length differently). No UI here: the app words the warnings itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from northcode.agent import server_process
from northcode.agent.client import ChatClient


@dataclass(frozen=True)
class ServedModel:
    model_id: str  # the id requests use
    label: str  # the whole name, e.g. "demo-tiny-seed0 (tiny preset, RANDOM WEIGHTS: output is noise)"
    random_weights: bool  # a demo or synthetic checkpoint: its answers are noise
    context_window: int | None  # tokens, where the endpoint states it
    served_ids: tuple[str, ...]  # every model id the endpoint serves

    @property
    def short_label(self) -> str:
        """The label for the status line, which has little room: "NAME (RANDOM WEIGHTS)" or the whole label."""
        return self.label.split(" (")[0] + " (RANDOM WEIGHTS)" if self.random_weights else self.label


async def describe_served_model(client: ChatClient) -> ServedModel:
    """Resolve the model requests use (the endpoint's first, unless set) and describe it from /v1/models."""
    model_id = await client.resolve_model()
    models = await client.list_models()
    card = next((m for m in models if m.get("id") == model_id), {"id": model_id})
    return ServedModel(model_id, server_process.model_label(card), server_process.has_random_weights(card),
                       context_window(models, model_id), tuple(str(m.get("id")) for m in models))


def context_window(models: list[dict], model_id: str) -> int | None:
    """The context length a /v1/models entry states (vLLM, llama.cpp and northcode spell it differently)."""
    for entry in models:
        if entry.get("id") != model_id:
            continue
        meta = entry.get("meta") if isinstance(entry.get("meta"), dict) else {}
        for value in (entry.get("max_model_len"), entry.get("context_length"), entry.get("context_window"),
                      meta.get("n_ctx"), meta.get("n_ctx_train")):
            if isinstance(value, int) and value > 0:
                return value
    return None
