"""SimModelRunner: the persistent batch of a simulated executor, without tensors.

It keeps what a real runner keeps per request (tokens, block count, sampling), applies each
step's diff with the same checks, and answers exactly as a real runner does: one output per
scheduled request, in the step's order, with a sampled token only where the step reaches the
request's last known token, and an error (state dropped) for a request it cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.host.model_runner_base import ModelRunnerBase
from common.host.settings import ExecutorConfig
from common.wire.config import ModelGeometry
from common.wire.step_types import RequestStepOutput, SamplingParams, StepInput, StepOutput
from executor_sim.sampler import FakeSampler


@dataclass
class SimRequest:
    """What the simulated executor remembers about one request."""

    request_id: str  # the controller's id
    token_ids: list[int]  # prompt followed by every generated token
    num_prompt_tokens: int  # length of the prompt part
    num_blocks: int  # KV blocks in its block table
    sampling: SamplingParams  # how to sample it
    prompt_key: int  # hash of the prompt: greedy output is a function of it


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
        self.requests: dict[str, SimRequest] = {}  # live requests by id
        self.last_shape = StepShape()  # the shape of the latest step

    # --- lifecycle (nothing to load or allocate) ----------------------------------------

    def load_model(self) -> None:
        """No weights: mark the runner loaded."""
        self.model = object()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Remember the block count; nothing is allocated."""
        self.num_blocks = num_blocks

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
        self.requests.clear()
        self.sampler.reseed(self.config.seed)

    # --- steps ----------------------------------------------------------------------------

    def _check(self, req: SimRequest, computed: int, scheduled: int) -> str:
        end = computed + scheduled
        if scheduled <= 0 or computed < 0:
            return f"bad schedule: {computed} computed, {scheduled} scheduled"
        if end > len(req.token_ids):
            return f"scheduled up to token {end} but only {len(req.token_ids)} are known"
        if end > self.geometry.max_model_len:
            return f"sequence length {end} exceeds max_model_len {self.geometry.max_model_len}"
        if -(-end // self.config.block_size) > req.num_blocks:
            return f"needs {-(-end // self.config.block_size)} KV blocks, has {req.num_blocks}"
        return ""

    def _apply(self, step: StepInput) -> tuple[list[tuple[SimRequest, int, int]], dict]:
        for rid in step.finished_request_ids:
            self.requests.pop(rid, None)
        runnable: list[tuple[SimRequest, int, int]] = []
        errors: dict[str, str] = {}
        vocab = self.geometry.vocab_size
        for new in step.new_requests:
            tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
            req = SimRequest(
                new.request_id,
                tokens,
                len(new.prompt_token_ids),
                len(new.block_ids),
                new.sampling,
                hash(tuple(new.prompt_token_ids)),
            )
            self.requests.pop(new.request_id, None)
            bad = ""
            if not new.prompt_token_ids:
                bad = "empty prompt"
            elif min(tokens) < 0 or max(tokens) >= vocab:
                bad = f"token id outside [0, {vocab})"
            bad = bad or self._check(req, new.num_computed_tokens, new.num_scheduled_tokens)
            if bad:
                errors[new.request_id] = bad
                continue
            self.requests[new.request_id] = req
            runnable.append((req, new.num_computed_tokens, new.num_scheduled_tokens))
        for cached in step.cached_requests:
            req = self.requests.get(cached.request_id)
            if req is None:
                errors[cached.request_id] = "unknown request (never sent, finished or failed)"
                continue
            req.num_blocks += len(cached.new_block_ids)
            bad = self._check(req, cached.num_computed_tokens, cached.num_scheduled_tokens)
            if bad:
                errors[cached.request_id] = bad
                del self.requests[cached.request_id]
                continue
            runnable.append((req, cached.num_computed_tokens, cached.num_scheduled_tokens))
        return runnable, errors

    def execute_model(self, step: StepInput) -> StepOutput:
        """Apply the diff and sample one fake token per request that reaches its end."""
        runnable, errors = self._apply(step)
        outputs = {rid: RequestStepOutput(rid, error=msg) for rid, msg in errors.items()}
        shape = StepShape(num_requests=len(runnable))
        sampler = self.sampler
        for req, computed, scheduled in runnable:
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
                token = sampler.sample(sampling, req.prompt_key, end, end - req.num_prompt_tokens)
                out.sampled_token_id = token
                if sampling.logprobs is not None:
                    out.logprobs = sampler.logprobs(token, sampling.logprobs)
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
