"""The TPU runner's warm-up plan: the fabricated steps that compile every program serving uses.

One run per (token bucket, request bucket) pair compiles the forward program (the first pair of
each token bucket also asks for prompt logprobs, compiling that program for the bucket); then,
per request bucket, one run per further sampling variant (at that bucket's smallest token
bucket, whose forward is compiled by then). Each run is a single fabricated row over the null
blocks, with sampling parameters that select its variant; a masked variant's row has every
token allowed (its mask words all ones).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.wire.step_types import SamplingParams
from executor_tpu.sampler import VARIANTS, SampleVariant
from executor_tpu.static_batch import BucketPlan

#: Sampling parameters whose rows select each sampling variant.
_VARIANT_PARAMS = {
    "greedy": SamplingParams(),
    "topk": SamplingParams(temperature=1.0, top_k=5, logprobs=1),
    "sort": SamplingParams(temperature=1.0, top_p=0.9),
}
#: Added for the variants that adjust the logits (penalties, min-tokens masking).
_ADJUST = dict(presence_penalty=0.1, repetition_penalty=1.1, min_tokens=1, stop_token_ids=[0])


@dataclass(frozen=True)
class FabricatedRun:
    """One fabricated step: a single row padded to the given shapes."""

    num_tokens: int  # tokens the row computes (capped by the runner to what its blocks hold)
    token_bucket: int  # the step's padded token count
    request_bucket: int  # the step's padded request count
    variant: SampleVariant  # the sampling program it runs
    prompt_logprobs: bool  # whether it also runs the prompt-logprob program
    label: str = ""  # what it compiles, for the warm-up log

    def sampling_params(self) -> SamplingParams:
        """Parameters whose row selects ``variant``."""
        params = _VARIANT_PARAMS[self.variant.kind]
        if self.variant.adjust:
            params = SamplingParams(**{**params.__dict__, **_ADJUST})
        return params


def warmup_runs(plan: BucketPlan) -> list[FabricatedRun]:
    """Every run of the warm-up, in order (forward shapes first, then sampling variants)."""
    pairs = plan.pairs()
    runs = []
    seen_tokens: set[int] = set()
    for t, r in pairs:
        label = f"forward {t} tokens x {r} requests"
        runs.append(FabricatedRun(t, t, r, VARIANTS[0], t not in seen_tokens, label))
        seen_tokens.add(t)
    for r in plan.request_buckets:
        t = min(tt for tt, rr in pairs if rr == r)
        for variant in VARIANTS[1:]:
            extras = (" + penalties" if variant.adjust else "") + (
                " + mask" if variant.masked else ""
            )
            label = f"sampling {variant.kind}{extras} x {r} requests"
            runs.append(FabricatedRun(1, t, r, variant, False, label))
    return runs
