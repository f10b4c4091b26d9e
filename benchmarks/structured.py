"""Structured output's cost: the same workload with 0%, 50% and 100% of its requests
constrained by a JSON schema, in one run, against one controller and one executor.

Every request asks for the same output length: a constrained one must produce a JSON object of
`--items` strings (the schema fixes the count), an unconstrained one generates as many tokens
(ignore_eos) as the constrained output took in a first, measuring request. Reported per mix,
as ratios to the unconstrained run: output tokens per second and TTFT p50; then the
unconstrained mix again on a second controller with --pipeline-depth 1: what constrained
requests cost their executor's steps besides the masks (their steps are not pipelined).
Measured offline on the same outputs: the time to compute one allowed-token mask (llguidance,
this model's vocabulary, per string schema), and the bytes a step puts on the wire per request
with and without a mask (step_to_pb) at this vocabulary and a ~150k one.

    python benchmarks/structured.py                  # CPU executor, default model
    python benchmarks/structured.py --executor sim   # simulated device: the controller's cost
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.wire.convert import step_to_pb  # noqa: E402
from common.wire.step_types import CachedRequestData, StepInput, token_mask_bytes  # noqa: E402
from controller.text.grammar import GrammarCompiler, json_schema_constraint  # noqa: E402
from controller.text.tokenizer import Tokenizer  # noqa: E402
from tests.support.processes import model_dir, start_server  # noqa: E402

PROMPT = "List some words, as JSON."


# String schemas whose mask cost differs by 40x in llguidance 1.x (its lexer for a short
# bounded repeat is costlier than for a long or an unbounded one); the workload uses the first.
WORDS = {
    "maxLength 40": {"type": "string", "maxLength": 40},
    "unbounded": {"type": "string"},
    "maxLength 6": {"type": "string", "maxLength": 6},
    "pattern [a-z0-9]{1,6}": {"type": "string", "pattern": "^[a-z0-9]{1,6}$"},
}


def schema(items: int, word: dict = WORDS["maxLength 40"]) -> dict:
    """The constrained requests' schema: exactly `items` strings."""
    words = {"type": "array", "items": word, "minItems": items, "maxItems": items}
    return {
        "type": "object",
        "properties": {"words": words},
        "required": ["words"],
        "additionalProperties": False,
    }


async def one(client, model: str, constrained: bool, a, max_tokens: int) -> tuple[float, int]:
    """(TTFT seconds, output tokens) of one streamed chat completion."""
    extra = {"ignore_eos": True}
    if constrained:
        extra["structured_outputs"] = {"json": schema(a.items)}
    start = time.perf_counter()
    ttft, tokens = 0.0, 0
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    async for chunk in stream:
        if not ttft and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return ttft, tokens


async def run_mix(server, a, share: float, max_tokens: int) -> dict:
    """`a.requests` requests, `a.concurrency` at a time; every 1/share-th one constrained."""
    sem = asyncio.Semaphore(a.concurrency)
    flags = [int((i + 1) * share) > int(i * share) for i in range(a.requests)]  # spread

    async with server.async_client(timeout=600) as client:

        async def task(flag):
            async with sem:
                return await one(client, server.model_name, flag, a, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(task(f) for f in flags))
        wall = time.perf_counter() - start
    tokens = sum(t for _, t in results)
    return {
        "constrained": sum(flags) / len(flags),
        "tokens_per_s": tokens / wall,
        "ttft_p50_s": statistics.median(t for t, _ in results),
        "output_tokens": tokens,
        "wall_s": wall,
    }


def mask_costs(model: str, items: int) -> dict:
    """Microseconds per allowed-token mask along a constrained output (per string schema of
    WORDS), and wire bytes per request per step with and without a mask, at this model's
    vocabulary and at ~150k."""
    tok = Tokenizer.from_model_dir(model)
    compiler = GrammarCompiler.for_tokenizer(tok)
    text = json.dumps({"words": [f"w{i}" for i in range(items)]}, separators=(",", ":"))
    ids = tok.encode(text, add_special_tokens=False)
    out: dict = {"mask_us": {}}
    for name, word in WORDS.items():
        compiled = compiler.compile(json_schema_constraint(schema(items, word)))
        matcher, times = compiled.matcher(), []
        for t in ids:
            start = time.perf_counter()
            matcher.allowed_mask()
            times.append(time.perf_counter() - start)
            assert matcher.accept(t), "the sample output does not match the schema"
        out["mask_us"][name] = {
            "p50": round(statistics.median(times) * 1e6, 1),
            "mean": round(statistics.mean(times) * 1e6, 1),
            "max": round(max(times) * 1e6, 1),
        }
    for vocab in (tok.vocab_size, 151_936):
        plain = CachedRequestData("chatcmpl-0123456789abcdef-0-0", [], 500, 1)
        masked = CachedRequestData(plain.request_id, [], 500, 1, b"\xff" * token_mask_bytes(vocab))
        size = [
            step_to_pb(StepInput(1, cached_requests=[r] * 64)).ByteSize() / 64
            for r in (plain, masked)
        ]
        out[f"wire_bytes_per_request_vocab{vocab}"] = {"plain": size[0], "masked": size[1]}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--executor", choices=["cpu", "sim"], default="cpu")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--items", type=int, default=12, help="strings per constrained output")
    p.add_argument("--json", help="write the results here too")
    a = p.parse_args(argv)
    model = model_dir()
    kind = "executor_sim" if a.executor == "sim" else "executor_gpu"
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(model, tmp, executor_kinds=(kind,))
        try:
            # The constrained output's length sets everyone's (one warm-up request).
            _, length = asyncio.run(run_one(server, a))
            mixes = [asyncio.run(run_mix(server, a, s, length)) for s in (0.0, 0.5, 1.0)]
        finally:
            server.stop()
        # What not pipelining costs alone: the unconstrained mix, every step waiting for the
        # previous result (as steps do while a constrained request is live).
        server = start_server(
            model, tmp, controller_args=["--pipeline-depth", "1"], executor_kinds=(kind,)
        )
        try:
            asyncio.run(run_one(server, a))  # the same warm-up
            serial = asyncio.run(run_mix(server, a, 0.0, length))
            serial["pipeline_depth"] = 1
            mixes.append(serial)
        finally:
            server.stop()
    base = mixes[0]
    for m in mixes:
        m["throughput_ratio"] = m["tokens_per_s"] / base["tokens_per_s"]
        m["ttft_ratio"] = m["ttft_p50_s"] / base["ttft_p50_s"]
    report = {"executor": a.executor, "output_tokens_each": length, "mixes": mixes}
    report.update(mask_costs(model, a.items))
    print(f"{'constrained':>11} {'tok/s':>8} {'ratio':>6} {'TTFT p50':>9} {'ratio':>6}")
    for m in mixes:
        print(
            f"{m['constrained']:>10.0%} {m['tokens_per_s']:>8.1f} {m['throughput_ratio']:>6.2f}"
            f" {m['ttft_p50_s'] * 1e3:>7.0f}ms {m['ttft_ratio']:>6.2f}"
            + ("  (not pipelined)" if m.get("pipeline_depth") == 1 else "")
        )
    print(json.dumps({k: v for k, v in report.items() if k != "mixes"}, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


async def run_one(server, a) -> tuple[float, int]:
    async with server.async_client(timeout=600) as client:
        return await one(client, server.model_name, True, a, 4096)


if __name__ == "__main__":
    main()
