"""A minimal controller for runner tests: token budget, chunked prefill, block allocation and
step diffs, driving any ModelRunnerBase in-process (the GPU runner on the CPU, the TPU runner
on XLA:CPU)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest

from common.wire.step_types import CachedRequestData, NewRequestData, SamplingParams, StepInput

MODEL_DIR = os.environ.get(
    "TANDEM_MODEL_DIR", os.path.expanduser("~/.cache/tandem/models/SmolLM2-135M-Instruct")
)


BLOCK = 16


needs_model = pytest.mark.skipif(
    not os.path.exists(os.path.join(MODEL_DIR, "config.json")),
    reason=f"default model not found at {MODEL_DIR}",
)


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    sampling: SamplingParams
    max_tokens: int
    output: list[int] = field(default_factory=list)
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    sent: bool = False
    prompt_logprobs: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    pending: int = 0  # tokens a step in flight samples (placeholders in its tokens)

    @property
    def tokens(self):
        return self.prompt + self.output


class MiniController:
    """Plays the controller: token budget, chunked prefill, block allocation, diffs."""

    def __init__(self, runner, budget=12, num_blocks=64):
        self.runner = runner
        self.budget = budget
        self.free = list(range(1, num_blocks))  # block 0 is the reserved null block
        self.running: list[_Req] = []
        self.finished: list[str] = []
        self.step_id = 0
        self._scheduled: dict[int, dict] = {}  # step id -> request id -> (req, n, samples)

    def add(self, rid, prompt, sampling=None, max_tokens=20, output=(), blocks=(), computed=0):
        """A request; ``blocks`` / ``computed`` start it on a cached prefix (a prefix hit: the
        blocks hold its first ``computed`` tokens already)."""
        req = _Req(rid, list(prompt), sampling or SamplingParams(), max_tokens, list(output))
        req.blocks, req.computed = list(blocks), computed
        self.running.append(req)
        return req

    def schedule(self) -> StepInput:
        """The next step (it may schedule nothing): every running request catches up with its
        tokens, a token the executor is still sampling included (a placeholder, as the
        controller's pipelined steps do)."""
        step = StepInput(step_id=self.step_id, finished_request_ids=self.finished)
        self.step_id += 1
        self.finished = []
        left = self.budget
        scheduled = {}
        for req in self.running:
            n = min(len(req.tokens) + req.pending - req.computed, left)
            if n <= 0 or len(req.output) + req.pending >= req.max_tokens:
                continue  # nothing to compute, or its last token is being sampled
            left -= n
            need = -(-(req.computed + n) // BLOCK) - len(req.blocks)
            new_blocks = [self.free.pop(0) for _ in range(need)]
            req.blocks += new_blocks
            if not req.sent:
                step.new_requests.append(
                    NewRequestData(
                        req.rid,
                        req.prompt,
                        list(req.output),
                        req.sampling,
                        list(req.blocks),
                        req.computed,
                        n,
                    )
                )
                req.sent = True
            else:
                step.cached_requests.append(CachedRequestData(req.rid, new_blocks, req.computed, n))
            req.computed += n
            samples = req.computed == len(req.tokens) + req.pending
            if samples:
                req.pending += 1  # sampled by this step; the next may compute it already
            scheduled[req.rid] = (req, n, samples)
        self._scheduled[step.step_id] = scheduled
        return step

    def apply(self, step: StepInput, out) -> None:
        """Take a step's output: sampled tokens replace placeholders, finished requests
        free their blocks."""
        scheduled = self._scheduled.pop(step.step_id)
        order = [r.request_id for r in step.new_requests + step.cached_requests]
        assert [o.request_id for o in out.outputs] == order
        for o in out.outputs:
            assert not o.error, o.error
            req, n, samples = scheduled[o.request_id]
            req.prompt_logprobs += o.prompt_logprobs
            if o.sampled_token_id is None:
                assert not samples
                continue
            assert samples
            req.pending -= 1
            req.output.append(o.sampled_token_id)
            req.logprobs.append(o.logprobs)
            if len(req.output) >= req.max_tokens:
                self.running.remove(req)
                self.free += req.blocks
                self.finished.append(req.rid)

    def step(self):
        """Schedule a step, run it, take its output."""
        step = self.schedule()
        out = self.runner.execute_model(step)
        self.apply(step, out)
        return out

    def run_overlapped(self) -> int:
        """Run every request to the end as the executor's servicer does with overlapped steps
        (common.host.step_pipeline.run_overlapped) under a controller with two steps in
        flight: step N+1 is scheduled before N's output is taken and launched before N is
        finished; returns the steps launched while another was in flight."""
        runner, overlapped = self.runner, 0
        launched = None  # (step, the runner's handle) in flight
        while self.running or launched:
            step = self.schedule() if self.running else None
            if step is not None and not step.num_requests and not step.finished_request_ids:
                self._scheduled.pop(step.step_id)
                step = None
            if launched is not None and (step is None or runner.step_needs_results(step)):
                self.apply(launched[0], runner.finish_step(launched[1]))
                launched = None
                if step is None:
                    continue
            if step is None:
                continue
            handle = runner.launch_step(step)
            if launched is not None:
                overlapped += 1
                self.apply(launched[0], runner.finish_step(launched[1]))
            launched = (step, handle)
        self.step()  # deliver the last finished ids
        return overlapped

    def run(self):
        while self.running:
            self.step()
        self.step()  # deliver the last finished ids


def assert_seeded_sampling_survives_recompute(runner, prompt: list[int]) -> None:
    """A seeded request preempted after 4 tokens and resumed by recompute (sent whole, as
    new) samples the same 10 tokens as an uninterrupted run."""
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    runner.reset()
    ctl = MiniController(runner, budget=64)
    whole = ctl.add("s", prompt, params, max_tokens=10)
    ctl.run()
    runner.reset()
    ctl = MiniController(runner, budget=64)
    part = ctl.add("s", prompt, params, max_tokens=4)
    ctl.run()
    resumed = ctl.add("s", prompt, params, max_tokens=10, output=part.output)
    ctl.run()
    assert resumed.output == whole.output
    assert len(set(whole.output)) > 1
