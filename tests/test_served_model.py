"""The served model as the app shows it: context length in each server's spelling, labels, random weights."""

from __future__ import annotations

from agent_scripted_endpoint import ScriptedEndpoint

from northcode.agent.client import ChatClient
from northcode.agent.served_model import ServedModel, context_window, describe_served_model


def test_context_window_in_each_servers_spelling():
    models = [{"id": "vllm", "max_model_len": 32768}, {"id": "other", "context_length": 8192},
              {"id": "llama", "meta": {"n_ctx_train": 131072}}, {"id": "llama-set", "meta": {"n_ctx": 4096}},
              {"id": "nothing", "max_model_len": 0, "meta": "not a dict"}]
    assert context_window(models, "vllm") == 32768 and context_window(models, "other") == 8192
    assert context_window(models, "llama") == 131072 and context_window(models, "llama-set") == 4096
    assert context_window(models, "nothing") is None and context_window(models, "missing") is None


def test_short_label_says_random_weights_in_few_characters():
    demo = ServedModel("demo", "demo-tiny-seed0 (tiny preset, RANDOM WEIGHTS: output is noise)", True, None, ("demo",))
    assert demo.short_label == "demo-tiny-seed0 (RANDOM WEIGHTS)"
    real = ServedModel("nm", "North-Mini-Code-1.0 (v2)", False, 8192, ("nm",))
    assert real.short_label == "North-Mini-Code-1.0 (v2)"


async def test_describe_reads_the_endpoints_model_card():
    card = {"random_weights": True, "display_name": "demo-tiny-seed0 (tiny preset, RANDOM WEIGHTS: output is noise)"}
    with ScriptedEndpoint([], context_len=2048, model_card=card) as endpoint:
        client = ChatClient(endpoint.url)
        try:
            served = await describe_served_model(client)
        finally:
            await client.aclose()
    assert served == ServedModel(client.model, card["display_name"], True, 2048, (client.model,))
    assert served.short_label == "demo-tiny-seed0 (RANDOM WEIGHTS)"
