"""New architectures served end to end (controller and GPU executor processes, gRPC between):
a tiny random windowed Mistral and a tiny Gemma 3 with the default model's tokenizer, under a
small step budget and few KV blocks. Greedy completions equal transformers' for prompts longer
than the window, two at once, then both again (prefix hits); for the
Mistral, whose every layer is windowed, the controller gives back blocks behind the window, so
both fit in a pool that could not hold their whole block tables."""

from __future__ import annotations

import os
import shutil

import httpx
import pytest

from tests.support.processes import start_server
from tests.support.tiny_models import WINDOW, hf_greedy, random_prompts, save_tiny_checkpoint

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

_WEIGHTS = ("config.json", "generation_config.json", "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mistral-window", "gemma3"])
def test_tiny_architecture_served_end_to_end(kind, default_model_dir, tmp_path):
    model = tmp_path / kind
    vocab = 49152  # the default tokenizer's
    hf = save_tiny_checkpoint(kind, str(model), vocab_size=vocab)
    for name in os.listdir(default_model_dir):  # tokenizer and chat template
        if name not in _WEIGHTS:
            shutil.copy(os.path.join(default_model_dir, name), model / name)
    blocks = 16 if kind == "mistral-window" else 40  # 2 x 160 tokens need 20 whole tables
    (tmp_path / "logs").mkdir()
    server = start_server(
        str(model),
        str(tmp_path / "logs"),
        controller_args=["--max-num-batched-tokens", "32", "--num-kv-blocks", str(blocks)],
    )
    try:
        prompts = random_prompts(5, [150, 140])
        want = [hf_greedy(hf, p, 8) for p in prompts]
        client = server.client()
        for _ in range(2):  # two sequences at once; the second round hits the cached prefixes
            reply = client.completions.create(
                model=server.model_name,
                prompt=prompts,
                max_tokens=8,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            assert [c.model_extra["token_ids"] for c in reply.choices] == want
        assert min(map(len, prompts)) > WINDOW
        if kind == "mistral-window":  # both fit at once: nobody was preempted (1 without)
            metrics = httpx.get(server.base_url + "/metrics").text
            samples = [x for x in metrics.splitlines() if x.startswith("vllm:num_preemptions")]
            assert samples and sum(float(x.split()[-1]) for x in samples) == 0, samples
    finally:
        server.stop()
