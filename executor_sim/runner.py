"""SimModelRunner: the persistent batch of a simulated executor, without tensors.

It keeps what a real runner keeps per request (tokens, block table, sampling) in the same
``RequestTable``, so it applies each step's diff with the same checks (common.host.step_check),
and answers exactly as a real runner does: one output per scheduled request, in the step's
order, with a sampled token only where the step reaches the request's last known token, and an
error (state dropped) for a request it cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.host.model_runner_base import ModelRunnerBase
from common.host.request_table import RequestState, RequestTable
from common.host.settings import ExecutorConfig
from common.wire.config import ModelGeometry
from common.wire.step_types import NewRequestData, RequestStepOutput, StepInput, StepOutput
from executor_sim.sampler import FakeSampler


@dataclass
class SimRequest(RequestState):
    """What the simulated executor remembers about one request: the common state, and a hash
    of the prompt (greedy output is a function of it)."""

    prompt_key: int = 0  # hash of the prompt

    @classmethod
    def from_new(cls, new: NewRequestData) -> SimRequest:
        state = super().from_new(new)
        state.prompt_key = hash(tuple(new.prompt_token_ids))
        return state


@dataclass
class StepShape:
    """Size of the step just run, for the latency model and the metrics."""

    num_tokens: int = 0  # tokens computed
    num_requests: int = 0  # requests computed
    num_context_tokens: int = 0  # tokens attended to (sequence lengths after the step)
    num_sampled: int = 0  # tokens sampled
    is_decode: bool = False  # no new request, one token each: a pure decode step


class SimModelRunner(ModelRunnerBase):
    """A model runner with no model: validates steps and samples fake tokens."""

    def __init__(self, config: ExecutorConfig, geometry: ModelGeometry, sampler: FakeSampler):
        super().__init__(config, geometry)
        self.sampler = sampler  # fake sampling
        self.table = RequestTable(self.step_limits(), SimRequest.from_new)  # live requests
        self.last_shape = StepShape()  # the shape of the latest step

    @property
    def requests(self) -> dict[str, SimRequest]:
        """Live requests by id."""
        return self.table.requests  # type: ignore[return-value]

    # --- lifecycle (nothing to load or allocate) ----------------------------------------

    def load_model(self) -> None:
        """No weights: mark the runner loaded."""
        self.model = object()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Remember the block count (steps are checked against it); nothing is allocated."""
        self.num_blocks = num_blocks
        self.table.limits = self.step_limits()

    def dummy_run(self, num_tokens: int, num_reqs: int) -> None:
        """Nothing to run."""

    def profile_run(self) -> int:
        """No activations."""
        return 0

    def capture_model(self) -> int:
        """No graphs."""
        return 0

    def reset(self) -> None:
        """Forget every request and restart unseeded sampling from the configured seed."""
        self.table.clear()
        self.table.limits = self.step_limits()  # InitDevice may have changed them
        self.sampler.reseed(self.config.seed)

    def forget(self, request_ids: list[str]) -> None:
        """Forget these requests."""
        self.table.forget(request_ids)

    # --- steps ----------------------------------------------------------------------------

    def execute_model(self, step: StepInput) -> StepOutput:
        """Apply the diff and sample one fake token per request that reaches its end."""
        runnable, errors = self.table.apply(step)
        outputs = {rid: RequestStepOutput(rid, error=msg) for rid, msg in errors.items()}
        shape = StepShape(num_requests=len(runnable))
        sampler = self.sampler
        for req, computed, scheduled in runnable:  # SimRequests (the table's make_state)
            end = computed + scheduled
            shape.num_tokens += scheduled
            shape.num_context_tokens += end
            out = RequestStepOutput(req.request_id)
            sampling = req.sampling
            if sampling.prompt_logprobs is not None and computed < req.num_prompt_tokens - 1:
                last = min(end, req.num_prompt_tokens - 1)
                out.prompt_logprobs = sampler.prompt_logprobs(
                    req.token_ids[computed + 1 : last + 1], sampling.prompt_logprobs
                )
            if end == len(req.token_ids):
                mask = req.allowed_token_mask  # structured output: this step's tokens
                outputs_so_far = end - req.num_prompt_tokens
                token = sampler.sample(sampling, req.prompt_key, end, outputs_so_far, mask)
                out.sampled_token_id = token
                if sampling.logprobs is not None:
                    allowed = sampler.allowed_bits(mask) if mask else None
                    out.logprobs = sampler.logprobs(token, sampling.logprobs, allowed)
                req.token_ids.append(token)
                shape.num_sampled += 1
            outputs[req.request_id] = out
        shape.is_decode = not step.new_requests and shape.num_tokens == shape.num_requests > 0
        self.last_shape = shape
        order = [r.request_id for r in step.new_requests] + [
            r.request_id for r in step.cached_requests
        ]
        ordered = [outputs.pop(rid) for rid in order if rid in outputs]
        return StepOutput(step_id=step.step_id, outputs=ordered)
