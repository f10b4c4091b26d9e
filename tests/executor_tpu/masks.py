"""Allowed-token masks for the TPU executor's tests: packing, and a runner wrapper that gives
constrained requests their masks as the controller would send them."""

from __future__ import annotations

import numpy as np

from common.wire.step_types import StepInput, StepOutput, token_mask_bytes

#: The allowed tokens of spmd_probe's constrained requests, by request id.
MASKED = {"m0": range(300, 700), "m2": range(30, 60)}


def pack(tokens, vocab_size: int) -> bytes:
    """The wire's packed bits (little-endian words, bit t % 32 of word t // 32) of a set."""
    bits = np.zeros(token_mask_bytes(vocab_size) * 8, np.uint8)
    bits[list(tokens)] = 1
    return np.packbits(bits, bitorder="little").tobytes()


class MaskingRunner:
    """Runs steps on ``runner`` with each constrained request's mask on its entries (on every
    entry: a runner only reads the mask of a row that samples)."""

    def __init__(self, runner, masks: dict[str, bytes]):
        self.runner = runner  # anything with execute_model (a worker or a model runner)
        self.masks = masks  # request id -> packed allowed tokens

    def execute_model(self, step: StepInput) -> StepOutput:
        for r in [*step.new_requests, *step.cached_requests]:
            r.allowed_token_mask = self.masks.get(r.request_id)
        return self.runner.execute_model(step)
