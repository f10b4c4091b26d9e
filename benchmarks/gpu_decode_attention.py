"""The decode attention kernel at the context lengths serving produces, over its launch settings.

gpu_step.py's attention sweep times whole tiles only (256 and 1024 tokens per request). Served
contexts end anywhere: a request at 257 tokens reads one token past its second 128-token tile,
and the kernel runs a third loop iteration for it. Here each shape is a batch of requests with
given lengths (all equal, or spread at random over a range, seeded), and each launch setting
(tile tokens x warps x context partitions) of ``executor_gpu/cuda/triton_attention.py`` is a
CUDA-graph replay; per shape: microseconds, the KV bandwidth it reaches, and the setting the
executor picks today. bf16, Llama-3-8B heads (32 query, 8 KV, 128 wide), 16-token blocks.
``--smoke`` runs a tiny version on the CPU under Triton's interpreter.

    python benchmarks/gpu_decode_attention.py --json /tmp/gpu_decode_attention.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.gpu_kernels import attention_shape, decode_inputs, rel_err, time_us  # noqa: E402
from common.torch.attention import _decode_attention  # noqa: E402
from executor_gpu.cuda import triton_attention as ta  # noqa: E402

#: (name, batch, low, high): request lengths uniform in [low, high] (equal when low == high).
SHAPES = [
    ("64x256", 64, 256, 256),
    ("64x257", 64, 257, 257),
    ("64x320", 64, 320, 320),
    ("64x200-330", 64, 200, 330),
    ("16x200-330", 16, 200, 330),
    ("64x1024", 64, 1024, 1024),
    ("64x900-1150", 64, 900, 1150),
]
SMOKE_SHAPES = [("3x40", 3, 40, 40), ("4x20-70", 4, 20, 70)]
TILES, WARPS, PARTS = (32, 64, 128), (4, 8), (1, 2, 4)
SMOKE_TILES, SMOKE_WARPS, SMOKE_PARTS = (32, 128), (4,), (1, 2)


def lengths_for(batch: int, low: int, high: int, seed: int = 0) -> list[int]:
    """Request lengths uniform in [low, high], the same for a given seed."""
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(batch)]


def sweep_shape(name, lengths, tiles, warps, parts, device, t0) -> list[dict]:
    """Every (tile, warps, parts) on one shape: us, TB/s of KV, error against the reference."""
    meta, kv, q = decode_inputs(len(lengths), lengths, device)
    tables, seq_lens = meta.block_tables, meta.seq_lens
    _, kv_heads, dim, _ = attention_shape(device)
    kv_bytes = 2 * sum(lengths) * kv_heads * dim * kv.element_size()
    ref = _decode_attention(q.double(), kv.double(), meta, 0.088)
    # What paged_decode_attention picks when it is given no setting.
    picked = (
        ta.partitions_for(len(lengths), kv_heads, device),
        ta.tile_for(ta.padded_dim(dim), kv.element_size()),
        ta.WARPS,
    )
    rows = []
    for tile, w, p in itertools.product(tiles, warps, parts):
        row = {"shape": name, "tile": tile, "warps": w, "parts": p}
        row["picked"] = (p, tile, w) == picked
        fn = lambda t=tile, w=w, p=p: ta.paged_decode_attention(  # noqa: E731
            q, kv, tables, seq_lens, 0.088, parts=p, tile=t, warps=w
        )
        try:
            row["rel_err"] = rel_err(fn(), ref)
            row["us"] = time_us(fn, device)
            row["TBps"] = kv_bytes / row["us"] / 1e6
        except Exception as e:  # a setting the compiler refuses: recorded, the sweep goes on
            row["error"] = repr(e)[:300]
        rows.append(row)
        print(f"[{time.perf_counter() - t0:6.1f}s]", json.dumps(row), flush=True)
    return rows


def summary(rows: list[dict]) -> dict:
    """Per shape: the picked setting's us and the fastest setting's us, with their ratio."""
    out = {}
    for name in dict.fromkeys(r["shape"] for r in rows):
        timed = [r for r in rows if r["shape"] == name and "us" in r]
        if not timed:
            continue
        best = min(timed, key=lambda r: r["us"])
        picked = next((r for r in timed if r["picked"]), None)
        out[name] = {
            "best": [best["tile"], best["warps"], best["parts"]],
            "best_us": best["us"],
            "picked_us": picked["us"] if picked else None,
            "picked_over_best": picked["us"] / best["us"] if picked else None,
        }
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    p.add_argument("--json", default="", help="write the report here")
    a = p.parse_args(argv)
    device = torch.device("cpu" if a.smoke else "cuda")
    shapes = SMOKE_SHAPES if a.smoke else SHAPES
    grid = (SMOKE_TILES, SMOKE_WARPS, SMOKE_PARTS) if a.smoke else (TILES, WARPS, PARTS)
    t0 = time.perf_counter()
    rows: list[dict] = []
    for name, batch, low, high in shapes:
        rows += sweep_shape(name, lengths_for(batch, low, high), *grid, device, t0)
    report = {"rows": rows, "summary": summary(rows)}
    for name, s in report["summary"].items():
        print(name, json.dumps(s))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
