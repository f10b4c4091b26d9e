"""Load generator for any OpenAI-compatible server: latency and throughput of streamed requests.

Sends ``--num-prompts`` synthetic prompts to ``/v1/completions`` (or ``/v1/chat/completions``)
with streaming, either at a fixed ``--concurrency`` or arriving as a Poisson process of
``--request-rate`` per second (both may be combined), and reports request throughput, output
and total token throughput, time to first token (TTFT), time per output token (TPOT),
inter-token latency (ITL) and end-to-end latency (E2E): mean, p50, p90, p99.

Prompts are made of common English words (about one token each); the server's usage counts
give the exact token numbers. Output length is fixed per request with ``ignore_eos`` and
``min_tokens`` (Tandem and vLLM honour both; ``--no-ignore-eos`` leaves them out).

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --concurrency 16 \\
        --num-prompts 64 --input-len 128 --output-len 64 --result-json /tmp/serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education foot boy age policy music market sense nation plan college interest death "
    "experience effect class control care field development role effort rate heart drug show "
    "leader light voice wife police mind price report decision son view relationship town "
    "road arm difference value building action model season society tax director position "
    "player record paper space ground form event official matter center couple site project "
    "activity star table need court oil situation cost industry figure street image phone"
).split()


@dataclass
class Workload:
    """The requests of one benchmark run."""

    num_prompts: int = 64  # requests to send
    input_len: tuple[int, int] = (128, 128)  # prompt words, drawn uniformly from [lo, hi]
    output_len: tuple[int, int] = (64, 64)  # output tokens, drawn uniformly from [lo, hi]
    shared_prefix_len: int = 0  # words every prompt of a group starts with
    num_prefix_groups: int = 1  # distinct shared prefixes (requests cycle through them)
    seed: int = 0  # seed of the prompt and length draws


@dataclass
class RequestSpec:
    """One request to send."""

    prompt: str  # the prompt text
    output_len: int  # max_tokens (and min_tokens unless --no-ignore-eos)


@dataclass
class RequestResult:
    """What one request measured."""

    ok: bool = False  # completed with a 200 and a finished stream
    error: str = ""  # why not
    prompt_tokens: int = 0  # from the server's usage (0 if it sent none)
    output_tokens: int = 0  # from usage, else the number of content chunks
    ttft: float = 0.0  # seconds from sending to the first content chunk
    e2e: float = 0.0  # seconds from sending to the end of the stream
    itl: list[float] = field(default_factory=list)  # seconds between content chunks


def parse_range(text: str) -> tuple[int, int]:
    """ "N" -> (N, N); "LO:HI" -> (LO, HI)."""
    lo, _, hi = text.partition(":")
    low, high = int(lo), int(hi or lo)
    if low < 1 or high < low:
        raise argparse.ArgumentTypeError(f"bad length {text!r}: want N or LO:HI with 1 <= LO <= HI")
    return low, high


def make_requests(w: Workload) -> list[RequestSpec]:
    """The workload's prompts (random words after an optional shared prefix) and lengths."""
    rng = random.Random(w.seed)
    prefixes = (
        [
            " ".join(rng.choices(WORDS, k=w.shared_prefix_len))
            for _ in range(max(1, w.num_prefix_groups))
        ]
        if w.shared_prefix_len
        else [""]
    )
    specs = []
    for i in range(w.num_prompts):
        words = rng.choices(WORDS, k=rng.randint(*w.input_len))
        prefix = prefixes[i % len(prefixes)]
        prompt = f"{prefix} {i}: " + " ".join(words) if prefix else f"{i}: " + " ".join(words)
        specs.append(RequestSpec(prompt, rng.randint(*w.output_len)))
    return specs


def percentiles(values: list[float], scale: float = 1e3) -> dict[str, float]:
    """Mean, p50, p90 and p99 (linear interpolation), scaled (seconds -> ms by default)."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def at(q: float) -> float:
        pos = q * (len(ordered) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return {
        "mean": scale * sum(ordered) / len(ordered),
        "p50": scale * at(0.5),
        "p90": scale * at(0.9),
        "p99": scale * at(0.99),
    }


class Progress:
    """A one-line progress bar on stderr (a line per 10% when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.enabled = total, 0, enabled  # requests, finished, shown
        self.tty = sys.stderr.isatty()  # redraw in place
        self.started = time.perf_counter()  # for the rate

    def step(self) -> None:
        """One more request finished."""
        self.done += 1
        if not self.enabled:
            return
        if not self.tty and self.done % max(1, self.total // 10) and self.done != self.total:
            return
        width = 30
        filled = width * self.done // max(1, self.total)
        rate = self.done / max(1e-9, time.perf_counter() - self.started)
        line = f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {rate:.2f} req/s"
        sys.stderr.write(("\r" + line) if self.tty else line + "\n")
        if self.tty and self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _body(endpoint: str, model: str, spec: RequestSpec, ignore_eos: bool) -> dict:
    body: dict = {
        "model": model,
        "max_tokens": spec.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if ignore_eos:
        body.update(ignore_eos=True, min_tokens=spec.output_len)
    return body


async def send_request(
    client: httpx.AsyncClient,
    base_url: str,
    endpoint: str,
    model: str,
    spec: RequestSpec,
    ignore_eos: bool = True,
) -> RequestResult:
    """Send one streamed request and time its content chunks."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    result = RequestResult()
    chunks: list[float] = []
    started = time.perf_counter()
    try:
        async with client.stream(
            "POST", base_url + path, json=_body(endpoint, model, spec, ignore_eos)
        ) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    result.ok = True
                    break
                msg = json.loads(data)
                if msg.get("usage"):
                    result.prompt_tokens = msg["usage"].get("prompt_tokens", 0)
                    result.output_tokens = msg["usage"].get("completion_tokens", 0)
                for choice in msg.get("choices") or []:
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if text:
                        chunks.append(time.perf_counter())
        if not result.ok:
            result.error = "stream ended without [DONE]"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e = time.perf_counter() - started
    if chunks:
        result.ttft = chunks[0] - started
        result.itl = [b - a for a, b in zip(chunks, chunks[1:])]
    result.output_tokens = result.output_tokens or len(chunks)
    return result


async def discover_model(base_url: str) -> str:
    """The first model the server lists."""
    async with httpx.AsyncClient(timeout=30) as client:
        resp = await client.get(base_url + "/v1/models")
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]


async def run_benchmark(
    base_url: str,
    model: str,
    specs: list[RequestSpec],
    concurrency: int = 0,
    request_rate: float = math.inf,
    endpoint: str = "completions",
    ignore_eos: bool = True,
    warmup: int = 1,
    progress: bool = True,
    timeout: float = 3600.0,
    seed: int = 0,
) -> dict:
    """Send every request (Poisson arrivals at ``request_rate``, at most ``concurrency`` in
    flight; 0 = no limit) and return the summary (see ``summarize``)."""
    base_url = base_url.rstrip("/")
    model = model or await discover_model(base_url)
    limit = concurrency or len(specs)
    limits = httpx.Limits(max_connections=limit + 1, max_keepalive_connections=limit + 1)
    rng = random.Random(seed + 1)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(timeout, connect=30.0), limits=limits
    ) as client:
        for spec in specs[:warmup]:
            warm = await send_request(
                client, base_url, endpoint, model, RequestSpec(spec.prompt, 4), ignore_eos
            )
            if not warm.ok:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
        gate = asyncio.Semaphore(limit)
        bar = Progress(len(specs), progress)

        async def one(spec: RequestSpec) -> RequestResult:
            async with gate:
                result = await send_request(client, base_url, endpoint, model, spec, ignore_eos)
            bar.step()
            return result

        started = time.perf_counter()
        tasks = []
        for spec in specs:
            tasks.append(asyncio.create_task(one(spec)))
            if math.isfinite(request_rate) and request_rate > 0:
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    summary = summarize(results, duration)
    summary.update(
        base_url=base_url,
        model=model,
        endpoint=endpoint,
        concurrency=concurrency,
        request_rate=request_rate if math.isfinite(request_rate) else "inf",
    )
    return summary


def summarize(results: list[RequestResult], duration: float) -> dict:
    """Throughput and latency statistics (milliseconds) over the completed requests."""
    done = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {
        "num_prompts": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": percentiles([r.ttft for r in done]),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles([x for r in done for x in r.itl]),
        "e2e_ms": percentiles([r.e2e for r in done]),
    }


def format_summary(s: dict) -> str:
    """A human-readable report of a summary."""
    lines = [
        f"{'completed / failed':<28}{s['completed']} / {s['failed']}",
        f"{'duration (s)':<28}{s['duration_s']:.2f}",
        f"{'input / output tokens':<28}{s['total_input_tokens']} / {s['total_output_tokens']}",
        f"{'request throughput (req/s)':<28}{s['request_throughput']:.2f}",
        f"{'output throughput (tok/s)':<28}{s['output_throughput']:.1f}",
        f"{'total throughput (tok/s)':<28}{s['total_token_throughput']:.1f}",
        f"{'':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        v = s[key]
        lines.append(
            f"{key:<12}" + "".join(f"{v[q]:>10.1f}" for q in ("mean", "p50", "p90", "p99"))
        )
    lines += [f"error: {e}" for e in s["errors"]]
    return "\n".join(lines)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload flags (shared with the other benchmarks)."""
    p.add_argument("--num-prompts", type=int, default=64, help="requests to send")
    p.add_argument(
        "--input-len",
        type=parse_range,
        default=(128, 128),
        help="prompt length in words (about tokens): N or LO:HI (uniform)",
    )
    p.add_argument(
        "--output-len",
        type=parse_range,
        default=(64, 64),
        help="output tokens: N or LO:HI (uniform)",
    )
    p.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="words of a prefix shared by the prompts of a group",
    )
    p.add_argument("--num-prefix-groups", type=int, default=1, help="distinct shared prefixes")
    p.add_argument("--seed", type=int, default=0)


def workload_from_args(a: argparse.Namespace) -> Workload:
    """The Workload the flags describe."""
    return Workload(
        a.num_prompts, a.input_len, a.output_len, a.shared_prefix_len, a.num_prefix_groups, a.seed
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    p.add_argument("--model", default="", help="model name (default: the server's first)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--concurrency", type=int, default=0, help="most requests in flight; 0 = any")
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (default: all at once)",
    )
    add_workload_args(p)
    p.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="let requests end at EOS (send no ignore_eos / min_tokens)",
    )
    p.add_argument("--warmup", type=int, default=1, help="short requests sent before timing")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--result-json", default="", help="write the summary here")
    a = p.parse_args(argv)
    specs = make_requests(workload_from_args(a))
    summary = asyncio.run(
        run_benchmark(
            a.base_url,
            a.model,
            specs,
            a.concurrency,
            a.request_rate,
            a.endpoint,
            not a.no_ignore_eos,
            a.warmup,
            not a.no_progress,
            a.timeout,
            a.seed,
        )
    )
    summary["workload"] = asdict(workload_from_args(a))
    print(format_summary(summary))
    if a.result_json:
        with open(a.result_json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
