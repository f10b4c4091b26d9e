"""TorchModelRunner: what every torch-based model runner shares, whatever the device.

A step goes through the same stages on every device:

1. apply the controller's diff to the persistent batch (``InputBatch.schedule``): the rows to
   compute, and per-request errors for requests that fail validation;
2. run the rows on the device (``run_rows``, the one stage each device implements: inputs,
   forward, logits, sampling, logprobs) and bring back host results (``RowResults``);
3. turn those into ``RequestStepOutput``s in the step's order, append sampled tokens to the
   requests' state, drop the state of requests that failed.

Stages 1-2 are ``launch_step`` and 3 is ``finish_step``. A device that computes apart from the
host splits stage 2 too (``launch_rows`` queues the work, ``finish_rows`` waits for it), so
that the servicer can launch the next step before finishing this one (executor_gpu.overlap):
the sampled token of a row then stands in the request's tokens as a placeholder until its step
is finished (``ScheduledRow.placeholder``), and a request dropped meanwhile is reported unknown.

Model loading, KV-cache allocation and the fabricated rows of warm-up / profiling runs are
shared too; a device adjusts them through small hooks (``load_device``, ``place_model``,
``kv_cache_shape``, ``after_kv_cache_allocated``). Nothing here names a device.
"""

from __future__ import annotations

import abc
import logging
import time
from dataclasses import dataclass, field

import torch

from common.host.model_runner_base import ModelRunnerBase
from common.host.settings import ExecutorConfig
from common.torch.input_batch import InputBatch, RequestState, ScheduledRow
from common.torch.models import build_model
from common.torch.parallel import SINGLE, TensorParallel, head_shard, stored_kv_heads
from common.wire.config import ModelGeometry
from common.wire.step_types import (
    RequestStepOutput,
    SamplingParams,
    StepInput,
    StepOutput,
    TokenLogprobs,
)

log = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,  # KV cache only: stored without scales, widened on read
}

#: Worst-case sampling for dummy runs: random with every filter, penalties and logprobs.
DUMMY_SAMPLING = SamplingParams(
    temperature=1.0,
    top_p=0.9,
    top_k=50,
    min_p=0.01,
    logprobs=5,
    presence_penalty=0.1,
    repetition_penalty=1.1,
)


@dataclass
class RowResults:
    """Host results of running a step's rows on the device; lists follow the rows' order."""

    sampled: list[int | None]  # sampled token per row; None where the row does not sample
    logprobs: list[TokenLogprobs | None]  # logprobs of that token, where asked for
    prompt_logprobs: list[list[TokenLogprobs]]  # prompt positions computed in this step
    failed: set[int] = field(default_factory=set)  # rows whose values were not finite

    @classmethod
    def empty(cls, num_rows: int) -> RowResults:
        """Results with nothing sampled and no logprobs, to fill in."""
        return cls([None] * num_rows, [None] * num_rows, [[] for _ in range(num_rows)])


@dataclass
class LaunchedStep:
    """A step whose device work is queued (``TorchModelRunner.launch_step``)."""

    step: StepInput  # the step
    started: float  # perf_counter() at its launch
    rows: list[ScheduledRow]  # its validated rows, in batch order
    errors: dict[str, str]  # request id -> error, for the requests that failed its checks
    pending: object  # what ``finish_rows`` takes (None: no rows)


def prompt_logprob_count(row: ScheduledRow, max_logprobs: int) -> int:
    """Top logprobs returned per prompt position of ``row`` (its request's ask, capped)."""
    return min(row.state.sampling.prompt_logprobs or 0, max_logprobs)


def split_prompt_logprobs(
    rows: list[ScheduledRow], row_ids: list[int], flat: list[TokenLogprobs | None]
) -> dict[int, list[TokenLogprobs]]:
    """Split prompt logprobs laid out row after row (``row_ids`` in order, each
    ``num_prompt_logprobs`` positions) into per-row lists."""
    result, pos = {}, 0
    for i in row_ids:
        n = rows[i].num_prompt_logprobs
        result[i] = [lp for lp in flat[pos : pos + n] if lp is not None]
        pos += n
    return result


class TorchModelRunner(ModelRunnerBase):
    """The shared torch runner: model, KV cache, persistent batch and the step skeleton.

    Subclasses set ``self.device`` (through ``__init__``), may override the hooks, and
    implement ``run_rows`` plus the warm-up methods of ``ModelRunnerBase``.
    """

    #: Registered name of the attention implementation (see common.torch.attention).
    attention_backend = "torch"

    def __init__(
        self,
        config: ExecutorConfig,
        geometry: ModelGeometry,
        device: torch.device,
        batch_device: torch.device | str | None = None,
        tp: TensorParallel = SINGLE,
    ):
        kind = self.device_kind_of(device)
        capability = torch.cuda.get_device_capability(device) if kind == "cuda" else None
        super().__init__(config, geometry, kind, capability)
        self.device = device  # where weights and the KV cache live
        self.tp = tp  # this rank's place among the devices the model is sharded over
        self.local_kv_heads = geometry.num_kv_heads  # KV heads this rank stores (load_model)
        self.dtype = DTYPES[self.precision.dtype]  # weights / activations dtype
        self.kv_dtype = DTYPES[self.precision.kv_cache_dtype]  # the KV cache's dtype
        log.info(
            "dtype %s (--dtype %s), KV cache %s (--kv-cache-dtype %s) on %s",
            self.precision.dtype,
            config.dtype,
            self.precision.kv_cache_dtype,
            config.kv_cache_dtype,
            kind,
        )
        self.kv_caches: list[torch.Tensor] = []  # one per layer, shape from kv_cache_shape()
        # Step tensors built by InputBatch.build go to batch_device (the device by default).
        self.input_batch = InputBatch(
            config.block_size, geometry.vocab_size, geometry.max_model_len, batch_device or device
        )
        self.weights_bytes = 0  # set by load_model()
        self._profiler: torch.profiler.profile | None = None  # while start_profile() is active

    # --- hooks ----------------------------------------------------------------------------

    @classmethod
    def device_kind_of(cls, device: torch.device) -> str:
        """The kind of ``device`` the dtype decisions use (common.host.dtypes): cuda, tpu or
        cpu (XLA:CPU counts as the CPU)."""
        return "cuda" if device.type == "cuda" else "cpu"

    def load_device(self) -> torch.device | str:
        """Where the checkpoint is loaded (the device itself unless overridden)."""
        return self.device

    def place_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move a loaded model to the device when it was loaded elsewhere."""
        return model

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's KV tensor (common.torch.attention's layout by default)."""
        g = self.geometry
        return (2, num_blocks, self.config.block_size, self.local_kv_heads, g.head_dim)

    def after_kv_cache_allocated(self) -> None:
        """Called once the KV tensors are allocated and bound."""

    def stored_kv_heads(self) -> int:
        """The model's KV heads, plus the replicas of a sharded model's (after load_model)."""
        if self.tp.size == 1 or self.model is None:
            return super().stored_kv_heads()
        args = self.model.args
        return stored_kv_heads(args.num_heads, args.num_kv_heads, self.tp.size)

    # --- lifecycle ------------------------------------------------------------------------

    def load_model(self) -> None:
        """Build the model, load its weights, place it on the device."""
        model = build_model(
            self.config.model,
            self.dtype,
            self.load_device(),
            self.geometry.max_model_len,
            self.config.load_format,
            self.tp,
        )
        args = model.args
        self.local_kv_heads = head_shard(
            args.num_heads, args.num_kv_heads, self.tp.size, self.tp.rank
        ).kv_count
        model.set_attention_backend(self.attention_backend)
        self.model = self.place_model(model)
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate num_blocks zeroed KV blocks per layer and bind them to the model."""
        self.kv_caches = []
        self.model.bind_kv_cache(None)
        shape = self.kv_cache_shape(num_blocks)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            for _ in range(self.geometry.num_layers)
        ]
        self.model.bind_kv_cache(self.kv_caches)
        self.num_blocks = num_blocks
        self.after_kv_cache_allocated()
        # Steps are checked against the blocks just allocated and the limits the controller
        # set in InitDevice (it may have lowered max_model_len since the batch was created).
        self.input_batch.set_limits(self.step_limits())

    def reset(self) -> None:
        """Forget every request."""
        self.input_batch.clear()
        if self.num_blocks:
            self.input_batch.set_limits(self.step_limits())

    def forget(self, request_ids: list[str]) -> None:
        """Forget these requests."""
        self.input_batch.table.forget(request_ids)

    def set_seed(self, seed: int) -> None:
        """torch's global seed."""
        torch.manual_seed(seed)

    def start_profile(self) -> None:
        """Start torch's profiler."""
        self._profiler = torch.profiler.profile(with_stack=False)
        self._profiler.__enter__()

    def stop_profile(self, trace_path: str) -> None:
        """Stop torch's profiler and export a Chrome trace."""
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self._profiler.export_chrome_trace(trace_path)
            self._profiler = None

    # --- steps ----------------------------------------------------------------------------

    def execute_model(self, step: StepInput) -> StepOutput:
        """Run one step; a request that fails (a check, non-finite values) gets an error and
        its state is dropped, the others are unaffected. A failure of the pass itself is
        raised: a device error (common.host.device_errors) ends the executor, any other fails
        the step's requests (the servicer decides)."""
        return self.finish_step(self.launch_step(step))

    def launch_step(self, step: StepInput) -> LaunchedStep:
        """Apply the step's diff and queue its device work (``launch_rows``); the next step may
        be launched before ``finish_step`` (see ``step_needs_results``)."""
        started = time.perf_counter()
        rows, errors = self.input_batch.schedule(step)
        return LaunchedStep(step, started, rows, errors, self.launch_rows(rows) if rows else None)

    def finish_step(self, launched: LaunchedStep) -> StepOutput:
        """The output of a launched step, in the step's order: its rows' results (waiting for
        the device) and the errors of the requests that failed."""
        step = launched.step
        outputs = {rid: RequestStepOutput(rid, error=msg) for rid, msg in launched.errors.items()}
        if launched.rows:
            results = self.finish_rows(launched.pending)
            outputs.update(self._assemble(launched.rows, results))
        order = [r.request_id for r in step.new_requests] + [
            r.request_id for r in step.cached_requests
        ]
        ordered = [outputs.pop(rid) for rid in order if rid in outputs]
        return StepOutput(
            step_id=step.step_id,
            outputs=ordered,
            device_seconds=time.perf_counter() - launched.started,
        )

    def step_needs_results(self, step: StepInput) -> bool:
        """Whether ``step`` reads a token the step in flight has not brought to the host yet
        (a request with penalties counts its generated tokens there): launch it only after
        that step is finished."""
        requests = self.input_batch.requests
        for cached in step.cached_requests:
            state = requests.get(cached.request_id)
            if state is not None and state.token_ids[-1] < 0 and state.sampling.has_penalties:
                return True
        return False

    def step_done(self, launched: LaunchedStep) -> bool:
        """Whether a launched step's device work is done (``finish_step`` would not wait)."""
        return launched.pending is None or self.rows_done(launched.pending)

    def rows_done(self, pending: object) -> bool:
        """Whether the rows ``launch_rows`` started are done (here they ran whole)."""
        return True

    def launch_rows(self, rows: list[ScheduledRow]) -> object:
        """Queue the device work of validated rows; ``finish_rows`` gives their host results.
        Here they run whole (``run_rows``)."""
        return self.run_rows(rows)

    def finish_rows(self, pending: object) -> RowResults:
        """The host results of rows ``launch_rows`` started."""
        assert isinstance(pending, RowResults)
        return pending

    @abc.abstractmethod
    def run_rows(self, rows: list[ScheduledRow]) -> RowResults:
        """Forward, logits, sampling and logprobs of validated rows; host results."""

    def _assemble(
        self, rows: list[ScheduledRow], results: RowResults
    ) -> dict[str, RequestStepOutput]:
        outputs: dict[str, RequestStepOutput] = {}
        for i, row in enumerate(rows):
            rid = row.state.request_id
            if row.state.dropped:  # let go after a failure while this step was in flight
                outputs[rid] = RequestStepOutput(rid, error="unknown request")
                continue
            if i in results.failed:
                outputs[rid] = RequestStepOutput(rid, error="non-finite values in the forward")
                self.input_batch.remove(rid)
                continue
            out = RequestStepOutput(rid, prompt_logprobs=results.prompt_logprobs[i])
            token = results.sampled[i] if row.samples else None
            if token is not None:
                out.sampled_token_id = token
                out.logprobs = results.logprobs[i]
                if row.placeholder is None:
                    row.state.token_ids.append(token)
                else:  # launch_rows left a placeholder the next step may already compute
                    row.state.token_ids[row.placeholder] = token
            outputs[rid] = out
        return outputs

    # --- fabricated work (profiling, warm-up) ---------------------------------------------

    def dummy_rows(
        self,
        num_tokens: int,
        num_reqs: int,
        computed: int = 0,
        sampling: SamplingParams = DUMMY_SAMPLING,
    ) -> list[ScheduledRow]:
        """``num_reqs`` fabricated rows sharing ``num_tokens`` tokens, each after ``computed``
        cached tokens, every block the reserved null block 0. No state is registered."""
        bs = self.config.block_size
        rows = []
        for i in range(num_reqs):
            n = num_tokens // num_reqs + (1 if i < num_tokens % num_reqs else 0)
            length = computed + n
            state = RequestState(
                f"dummy-{i}",
                [i % self.geometry.vocab_size] * length,
                length,
                [0] * -(-length // bs),
                sampling,
            )
            rows.append(ScheduledRow(state, computed, n, True, 0))
        return rows
