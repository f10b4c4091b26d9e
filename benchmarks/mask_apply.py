"""What structured output's allowed-token masks cost the CPU executor's sampler.

For each vocabulary size V and batch size B, the same fabricated float32 logits [B, V] are
sampled two ways, alternately so that a shared machine's noise falls on both alike:

- ``unmasked``: the step as an unconstrained batch runs it (``build_sampling_metadata`` then
  the ``Sampler``: no mask tensor is built);
- ``masked``: every row constrained, as the executor runs it: the packed masks (a random tenth
  of the vocabulary allowed, with half the row's favourite tokens) joined and copied as bytes,
  unpacked and applied before sampling.

The logits are shaped like a model's: a few favourite tokens per row hold nearly all the mass
(with flat random logits top_p's nucleus would reach past its candidates and the full sort it
then falls back to would dominate both sides).

Both sampling modes of a step are measured: greedy, and random (temperature 0.8, top_p 0.95,
logprobs 5). The table gives each median, the masked time as a ratio of the unmasked one, the
mask part alone (building the packed tensor, unpacking, -inf fill) and the mask bytes one
constrained request adds to a step on the wire. Medians and bests (the least disturbed
repetition: on a shared machine the medians move by 2x between runs) are both given.

    python benchmarks/mask_apply.py --vocabs 49152,151936 --batch-sizes 1,16,64 --json /tmp/m.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from common.torch.sampling import Sampler, build_sampling_metadata  # noqa: E402
from common.torch.token_mask import apply_token_masks, mask_tensors  # noqa: E402
from common.wire.step_types import SamplingParams, token_mask_bytes  # noqa: E402

FAVOURITES = 8  # tokens per row holding nearly all of the probability

MODES = {
    "greedy": SamplingParams(),
    "random": SamplingParams(temperature=0.8, top_p=0.95, logprobs=5),
}


def fake_logits(batch: int, vocab: int, seed: int) -> tuple[torch.Tensor, list[list[int]]]:
    """Logits shaped like a language model's (a few favourites holding nearly all the mass, so
    that top_p's nucleus is among them, as with real models) and each row's favourites."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen) * 1.5
    favourites = torch.randint(0, vocab, (batch, FAVOURITES), generator=gen)
    logits.scatter_add_(1, favourites, torch.full((batch, FAVOURITES), 15.0))
    return logits, favourites.tolist()


def random_masks(
    vocab: int, favourites: list[list[int]], seed: int, fraction: float = 0.1
) -> list[bytes]:
    """One packed mask per row, allowing a random ``fraction`` of the vocabulary and half the
    row's favourites (a grammar agrees with a well-prompted model on some of its choices)."""
    rng = random.Random(seed)
    size = token_mask_bytes(vocab)
    masks = []
    for row in favourites:
        bits = 0
        for t in rng.sample(range(vocab), max(1, int(vocab * fraction))) + row[::2]:
            bits |= 1 << t
        masks.append(bits.to_bytes(size, "little"))
    return masks


def _sample_ms(sampler, logits, params, masks) -> float:
    start = time.perf_counter()
    n = len(params)
    meta = build_sampling_metadata(
        params, [100] * n, [()] * n, [()] * n, logits.shape[1], "cpu", masks=masks
    )
    sampler(logits, meta)
    return (time.perf_counter() - start) * 1e3


def _mask_only_ms(logits, masks) -> float:
    start = time.perf_counter()
    rows, packed = mask_tensors(masks, "cpu")
    apply_token_masks(logits, rows, packed)
    return (time.perf_counter() - start) * 1e3


def measure(vocab: int, batch: int, mode: str, reps: int) -> dict:
    """Median times of one (vocabulary, batch, mode) point, alternating masked and not."""
    logits, favourites = fake_logits(batch, vocab, seed=batch)
    params = [MODES[mode]] * batch
    masks = random_masks(vocab, favourites, seed=vocab + batch)
    sampler = Sampler(0)
    times: dict[str, list[float]] = {"unmasked": [], "masked": [], "mask": []}
    for _ in range(2):  # warm-up
        _sample_ms(sampler, logits, params, None)
        _sample_ms(sampler, logits, params, masks)
    for _ in range(reps):
        times["unmasked"].append(_sample_ms(sampler, logits, params, None))
        times["masked"].append(_sample_ms(sampler, logits, params, masks))
        times["mask"].append(_mask_only_ms(logits, masks))
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}  # the least disturbed by other processes
    return {
        "vocab": vocab,
        "batch": batch,
        "mode": mode,
        "unmasked_ms": med["unmasked"],
        "masked_ms": med["masked"],
        "mask_ms": med["mask"],
        "ratio": med["masked"] / med["unmasked"],
        "best_unmasked_ms": best["unmasked"],
        "best_masked_ms": best["masked"],
        "best_mask_ms": best["mask"],
        "best_ratio": best["masked"] / best["unmasked"],
        "mask_bytes_per_request": token_mask_bytes(vocab),
    }


def _row(r: dict) -> str:
    def pair(key: str, unit: str = " ms", fmt: str = ".3f") -> str:
        return f"{r[key]:{fmt}}{unit} ({r['best_' + key]:{fmt}})"

    return (
        f"| {r['vocab']:,} | {r['batch']} | {r['mode']} | {pair('unmasked_ms')} "
        f"| {pair('masked_ms')} | {pair('ratio', 'x', '.2f')} | {pair('mask_ms')} "
        f"| {r['mask_bytes_per_request']:,} |"
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocabs", default="49152,151936")
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--reps", type=int, default=30, help="timed repetitions per point")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    print(
        "| vocab | batch | mode | unmasked: median (best) | masked: median (best) "
        "| ratio: median (best) | mask part: median (best) | mask bytes/request |"
    )
    print("|---|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for vocab in (int(v) for v in args.vocabs.split(",")):
            for batch in (int(b) for b in args.batch_sizes.split(",")):
                for mode in args.modes.split(","):
                    r = measure(vocab, batch, mode, args.reps)
                    results.append(r)
                    print(_row(r), flush=True)
    if args.json:
        meta = {"threads": torch.get_num_threads(), "torch": torch.__version__}
        with open(args.json, "w") as f:
            json.dump({"context": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
