"""Throughput of Tandem vs transformers `generate` with static batching, same prompts, one run.

Starts a local controller + executor_gpu (real processes), sends N concurrent completion
requests with the official openai client, then runs transformers `generate` on the same prompts
as one batch in this process, and prints both throughputs and their ratio.

    python benchmarks/throughput_vs_hf.py --concurrency 32 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support.processes import model_dir, start_server  # noqa: E402

TOPICS = [
    "the ocean",
    "a robot",
    "mountains",
    "coffee",
    "a library",
    "the moon",
    "trains",
    "a garden",
    "winter",
    "music",
    "a city at night",
    "bees",
    "a lighthouse",
    "chess",
    "volcanoes",
    "a bakery",
]


def make_prompts(n: int) -> list[str]:
    return [f"Write a short story about {TOPICS[i % len(TOPICS)]} (#{i})." for i in range(n)]


async def run_tandem(base_url: str, model: str, prompts: list[str], max_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", timeout=600)
    # Warm-up request (first-step effects).
    await client.completions.create(model=model, prompt="Hi", max_tokens=4, temperature=0)
    started = time.perf_counter()
    results = await asyncio.gather(
        *(
            client.completions.create(
                model=model,
                prompt=p,
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            for p in prompts
        )
    )
    seconds = time.perf_counter() - started
    tokens = sum(r.usage.completion_tokens for r in results)
    return {"seconds": seconds, "tokens": tokens, "tok_per_s": tokens / seconds}


def run_hf(path: str, prompts: list[str], max_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batch = tok(prompts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        model.generate(**tok(["Hi"], return_tensors="pt"), max_new_tokens=4, do_sample=False)
        started = time.perf_counter()
        out = model.generate(
            **batch,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=tok.eos_token_id,
        )
        seconds = time.perf_counter() - started
    tokens = (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts)
    return {"seconds": seconds, "tokens": tokens, "tok_per_s": tokens / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=model_dir())
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", help="write results here")
    args = p.parse_args()
    prompts = make_prompts(args.concurrency)
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(args.model, tmp)
        try:
            tandem = asyncio.run(
                run_tandem(server.base_url, server.model_name, prompts, args.max_tokens)
            )
        finally:
            server.stop()
    hf = run_hf(args.model, prompts, args.max_tokens)
    result = {
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "tandem": tandem,
        "transformers_static_batch": hf,
        "ratio": tandem["tok_per_s"] / hf["tok_per_s"],
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
