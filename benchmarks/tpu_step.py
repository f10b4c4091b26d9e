"""The TPU executor's step, sharded or not: time per step and what the partitioned programs
communicate.

For each ``--tensor-parallel-size`` the script starts the TPU worker (a TPU if present, else
XLA:CPU with that many virtual devices), warms up one (token bucket, request bucket) pair,
times ``--steps`` greedy steps of that shape (a step's cost depends only on its buckets: every
shape is static), and reads the programs XLA compiled, after SPMD partitioning, from its dump
(``--xla_dump_to``): per program, the collectives it runs (all-reduce, all-gather,
all-to-all, collective-permute) and the bytes of their results. The forward program's figure
is the per-device communication volume of one step (before the ring's ``2 (N-1)/N`` factor).

On XLA:CPU the times are the host's, not a TPU's; the collectives are those of the same
partitioned program (the TPU compiler may fuse them differently). SPMD is process-wide, so
each size runs in a child process of this script.

    python benchmarks/tpu_step.py --tensor-parallel-size 1 2 --tokens 16 --requests 8 \\
        --json /tmp/tpu_step.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_MODEL = os.path.expanduser("~/.cache/tandem/models/SmolLM2-135M-Instruct")
COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute")
_COLLECTIVE = re.compile(
    r"=\s*\(?(?P<shapes>[^=]*?)\)?\s+(?P<kind>" + "|".join(COLLECTIVES) + r")(?:-start)?\("
)
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16)\[([0-9,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}


def collectives(hlo_text: str) -> dict[str, list[int]]:
    """Per collective kind in an HLO module's text: [count, bytes of the results]."""
    found: dict[str, list[int]] = {}
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        size = 0
        for dtype, dims in _SHAPE.findall(m.group("shapes")):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            size += n * _BYTES.get(dtype, 8 if dtype.endswith("64") else 4)
        entry = found.setdefault(m.group("kind"), [0, 0])
        entry[0] += 1
        entry[1] += size
    return found


def read_dump(dump_dir: str) -> list[dict]:
    """The compiled programs of a dump (after optimizations), forward first: the one with the
    most parameters (the weights are its inputs)."""
    programs = []
    for path in glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")):
        with open(path) as f:
            text = f.read()
        entry = text[text.find("ENTRY") :]
        params = entry[: entry.find("\n")].count("param")
        name = os.path.basename(path).split(".")[1]
        programs.append({"program": name, "params": params, "collectives": collectives(text)})
    return sorted(programs, key=lambda p: -p["params"])


def run_one(args: argparse.Namespace) -> dict:
    """In the child: warm up one bucket pair, time greedy steps, read the dump."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch

    from common.host.settings import ExecutorConfig
    from executor_tpu.options import TPUOptions
    from executor_tpu.worker import TPUWorker

    cfg = ExecutorConfig(
        model=args.model,
        max_model_len=args.max_model_len,
        kv_cache_bytes=256 * 2**20,
        tensor_parallel_size=args.size,
        load_format=args.load_format,
    )
    options = TPUOptions(
        token_buckets=[args.tokens], request_buckets=[args.requests], compile_cache_dir=""
    )
    worker = TPUWorker(cfg, options)
    worker.init_device()
    worker.load_model()
    worker.configure(args.tokens, args.requests, args.max_model_len)
    worker.initialize_cache(max(64, args.requests * 4))
    runner = worker.model_runner
    times = []
    with torch.no_grad():
        for _ in range(args.steps):
            started = time.perf_counter()
            runner.dummy_run(args.tokens, args.requests)
            times.append((time.perf_counter() - started) * 1e3)
    programs = read_dump(args.dump_dir)
    return {
        "tensor_parallel_size": args.size,
        "device": worker.device_name,
        "tokens": args.tokens,
        "requests": args.requests,
        "step_ms_median": statistics.median(times),
        "weights_bytes_per_device": runner.chip_weights_bytes,
        "kv_bytes_per_block": runner.get_kv_cache_spec().bytes_per_block,
        "compiled_after_warmup": runner.compile_watch.after_warmup,
        "forward_collectives": programs[0]["collectives"] if programs else {},
        "programs": programs,
    }


def run_size(args: argparse.Namespace, size: int) -> dict:
    """One size in a child process with its own XLA dump directory."""
    with tempfile.TemporaryDirectory() as dump:
        env = dict(os.environ)
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text"
        env.pop("CPU_NUM_DEVICES", None)
        out = os.path.join(dump, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", str(size), "--out", out]
        cmd += ["--model", args.model, "--tokens", str(args.tokens)]
        cmd += ["--requests", str(args.requests), "--steps", str(args.steps)]
        cmd += ["--max-model-len", str(args.max_model_len), "--load-format", args.load_format]
        subprocess.run(cmd, env=env, check=True)
        with open(out) as f:
            return json.load(f)


def print_table(results: list[dict]) -> None:
    """One row per size: step time, weights per device, the forward's collectives."""
    print(f"{'tp':>3} {'step ms':>9} {'weights/dev MiB':>16}  forward collectives (count, bytes)")
    for r in results:
        coll = ", ".join(f"{k} {c} ({b} B)" for k, (c, b) in r["forward_collectives"].items())
        print(
            f"{r['tensor_parallel_size']:>3} {r['step_ms_median']:>9.1f} "
            f"{r['weights_bytes_per_device'] / 2**20:>16.1f}  {coll or 'none'}"
        )


def main() -> None:
    """Parse flags; run each size (or, as a child, one)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tensor-parallel-size", type=int, nargs="+", default=[1, 2])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--load-format", default="auto", help="auto, or dummy (random weights)")
    p.add_argument("--tokens", type=int, default=16, help="the token bucket timed")
    p.add_argument("--requests", type=int, default=8, help="the request bucket timed")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        args.size = args.child
        args.dump_dir = re.search(r"--xla_dump_to=(\S+)", os.environ["XLA_FLAGS"]).group(1)
        with open(args.out, "w") as f:
            json.dump(run_one(args), f)
        return
    results = [run_size(args, size) for size in args.tensor_parallel_size]
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
