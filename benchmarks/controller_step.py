"""The controller's own cost per step, in one process, with no network in the way.

`controlplane.py` measures the whole controller process against simulated executors over gRPC
and HTTP; its figures move with whatever else the machine runs. This script isolates the part
that grows with running requests: one `ExecutorSession` (the real scheduler, KV manager, step
loop, result handling, metrics and delivery) drives a simulated executor called in-process
through the step's protobuf round trip (so conversions are counted), while R non-streamed
requests are kept running through `Engine.generate` (what the API handler consumes). The
executor's own time is measured apart and left out.

    python benchmarks/controller_step.py --running 16,64,256,1024 [--profile out.pstats]
    python benchmarks/controller_step.py --running 64,256 --stream

With `--stream` the requests are streamed /v1/completions responses: each runs the API's SSE
generator (`controller/api/streaming.py`: detokenizer, chunk templates, the direct write from
the step loop) over an in-memory connection that takes every chunk and drops it, so the
figure is the streamed path's Python cost without the socket's system calls. With `--tokens`
they are streamed as `--stream-writers N` serves them: the step loop hands each step's token
ids to the request's writer sink (`TokenSink`), which packs them into the writer's frame (the
real frame builder; one frame per step, built and dropped): the core's cost of a streamed
token with writers, whose own work happens in other processes.

    python benchmarks/controller_step.py --running 64,256 --tokens

Per point it reports the controller's CPU per step and per request-step (CPU time of the
process minus the executor's, over a window of steps), and the steps per second that leaves.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.host.settings import ExecutorConfig  # noqa: E402
from common.wire import convert  # noqa: E402
from common.wire.pb import executor_pb2 as pb  # noqa: E402
from common.wire.step_types import (  # noqa: E402
    SamplingParams,
    StepInput,
    StepOutput,
    TokenLogprobs,
)
from controller.core.outputs import GenerationRequest  # noqa: E402
from controller.fleet.client import HandshakeResult  # noqa: E402
from controller.fleet.engine import Engine  # noqa: E402
from controller.fleet.session import ExecutorSession  # noqa: E402
from controller.main import tune_gc  # noqa: E402
from controller.settings import ControllerConfig  # noqa: E402
from controller.text.tokenizer import Tokenizer  # noqa: E402
from executor_sim.latency import LatencyModel  # noqa: E402
from executor_sim.worker import SimOptions, SimWorker  # noqa: E402
from tests.support.processes import model_dir  # noqa: E402


@dataclass
class StepCost:
    """One point: the controller's cost at a number of running requests."""

    running: int  # requests kept running
    steps: int  # steps in the window
    batch: float  # mean requests per step
    cpu_ms_per_step: float  # controller CPU per step (executor excluded)
    cpu_us_per_request_step: float  # the same per scheduled request
    executor_ms_per_step: float  # the in-process executor's time per step (excluded above)


class _NullConnection:
    """A client connection that always takes a chunk at once and drops it (DirectWrite's
    interface)."""

    def writable(self) -> bool:
        return True

    def write(self, body: bytes) -> None:
        del body


class _NoAdmission:
    """Admission's side of a Ticket: nothing to release."""

    def _release(self, sequences: int, tokens: int) -> None:
        del sequences, tokens


async def stream_one(engine: Engine, gen: GenerationRequest, tokenizer: Tokenizer) -> None:
    """One streamed /v1/completions response through the API's SSE generator."""
    from controller.api.admission import Ticket
    from controller.api.deltas import DeltaQueue
    from controller.api.formats import CompletionFormatter, Prompt, ResponseMeta
    from controller.api.streaming import sse_events

    meta = ResponseMeta(f"cmpl-{gen.request_id}", int(time.time()), "bench")
    fmt = CompletionFormatter(tokenizer, meta, [Prompt(gen.prompt_token_ids, None)], 1, False, None)
    queue = DeltaQueue()
    queue.connection = _NullConnection()
    ticket = Ticket(_NoAdmission(), [len(gen.prompt_token_ids)])
    events = sse_events(engine, [gen], fmt.stream_chunk, fmt, False, ticket, queue)
    async for _ in events:
        pass


class _FrameChannel:
    """Stands in for a stream writer's channel (`controller/api/writers/pool.py`
    `WriterChannel`): the real frame builder, one frame per step, built and dropped instead of
    sent; a sequence's end sets its event."""

    def __init__(self) -> None:
        from controller.api.writers import frame as fr

        self.builder = fr.StepBuilder()  # this step's frame
        self.flush_due = False  # a flush is scheduled on the loop
        self.loop = asyncio.get_running_loop()
        self.done: dict[int, asyncio.Event] = {}  # slot -> set when its sequence ends
        self.frames = 0  # frames built
        self.failed = 0  # sequences ended by an error (the run then fails: it measured errors)

    def usage(self, slot: int, num_cached_tokens: int) -> None:
        del slot, num_cached_tokens

    def add(
        self,
        slot: int,
        token_ids: list[int],
        finish_reason: str | None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> None:
        self.builder.add(slot, token_ids, finish_reason, logprobs)
        if finish_reason is not None:
            self.done.pop(slot).set()
        if not self.flush_due:
            self.flush_due = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self.flush_due = False
        if len(self.builder):
            self.builder.take()
            self.frames += 1

    def fail(self, slot: int, event: bytes) -> None:
        self.failed += 1
        self.done.pop(slot).set()


async def tokens_one(engine: Engine, gen: GenerationRequest, channel: _FrameChannel) -> None:
    """One streamed response as `--stream-writers` serves it: the step loop hands its token
    ids to a writer's sink (`TokenSink`), which packs them into the writer's frame."""
    from controller.api.writers.pool import TokenSink

    slot = int(gen.request_id[1:])
    done = channel.done[slot] = asyncio.Event()
    tracked = engine.submit(gen, TokenSink(channel, slot, None))  # type: ignore[arg-type]
    try:
        await done.wait()
    finally:
        if not done.is_set():
            engine.abort(tracked)


class InProcessExecutor:
    """Stands in for ExecutorClient: a SimWorker called directly, through the step's and the
    result's protobuf round trip; the time spent on the executor's side is summed apart."""

    def __init__(self, model: str, num_blocks: int):
        self.worker = SimWorker(
            ExecutorConfig(model=model),
            SimOptions(latency=LatencyModel(0.0, 0.0), num_blocks=num_blocks),
        )
        self.sent: list[bytes] = []  # serialized steps not yet run, oldest first
        self.executor_seconds = 0.0  # time spent as the executor
        self.scheduled = 0  # requests scheduled in the steps run
        self.steps = 0  # steps run
        self.address = "in-process"  # for task names
        self.owner_id = ""  # an ownerless session: no lease to renew or release
        self.generation = 0  # the session generation (fencing): none here
        self.granted_seconds = 0.0  # no lease
        self.step_transport = "in-process"  # how steps go: a call in this process

    async def check_health(self, timeout: float) -> str:
        return "SERVING"

    async def release_session(self, timeout: float) -> bool:
        return False  # nothing to release: ownerless

    async def identify(self, timeout: float) -> str:
        return self.worker.incarnation_id

    async def handshake(
        self,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        seed: int,
        num_blocks_override: int = 0,
        kind_limits=None,
        timeout: float = 0.0,
    ) -> HandshakeResult:
        w = self.worker
        w.init_device()
        w.load_model()
        w.configure(max_num_batched_tokens, max_num_seqs, max_model_len)
        w.reset()
        info = convert.device_info_from_pb(convert.device_info_to_pb(w.describe()))
        memory = w.determine_available_memory()
        num_blocks = num_blocks_override or memory.available_kv_bytes // (
            info.kv_cache.bytes_per_block
        )
        w.initialize_cache(num_blocks)
        return HandshakeResult(info, memory, num_blocks, 0.0)

    async def send_step(self, step: StepInput) -> None:
        self.sent.append(convert.step_to_pb(step).SerializeToString())

    async def receive_result(self, step: StepInput) -> StepOutput:
        started = time.process_time()
        request = pb.StepRequest.FromString(self.sent.pop(0))
        step_in = convert.step_from_pb(request)
        self.scheduled += len(step_in.new_requests) + len(step_in.cached_requests)
        self.steps += 1
        output = self.worker.execute_model(step_in)
        wire = convert.result_to_pb(output, step_in).SerializeToString()
        self.executor_seconds += time.process_time() - started
        await asyncio.sleep(0)  # the result "arrives": other tasks run, as with a real stream
        return convert.result_from_pb(pb.StepResult.FromString(wire))

    async def close_stream(self) -> None:
        self.sent.clear()

    async def close(self) -> None:
        self.sent.clear()


async def measure_point(
    model: str,
    tokenizer: Tokenizer,
    running: int,
    steps: int,
    input_len: int,
    output_len: int,
    stream: bool = False,
    tokens: bool = False,
) -> StepCost:
    blocks = (running + 8) * ((input_len + output_len) // 16 + 2) + 64
    config = ControllerConfig(
        model=model,
        max_num_seqs=running,
        max_num_batched_tokens=max(2048, running),
        num_kv_blocks=blocks,
        health_check_interval=3600.0,
    )
    engine = Engine(config, tokenizer)
    session = ExecutorSession(engine, config, engine.metrics, "in-process")
    executor = InProcessExecutor(model, blocks)
    session.client = executor
    session.health.client = executor
    engine.sessions[session.address] = session
    session.start()
    await engine.wait_for_executor(timeout=60)
    vocab = tokenizer.vocab_size
    rng = random.Random(0)
    stop = asyncio.Event()
    serial = 0
    channel = _FrameChannel()

    async def client() -> None:
        nonlocal serial
        while not stop.is_set():
            serial += 1
            gen = GenerationRequest(
                f"r{serial}",
                [rng.randrange(100, vocab) for _ in range(input_len)],
                SamplingParams(temperature=0.0),
                max_tokens=output_len,
                ignore_eos=True,
                stream=stream,
            )
            if tokens:
                await tokens_one(engine, gen, channel)
                continue
            if stream:
                await stream_one(engine, gen, tokenizer)
                continue
            async for _ in engine.generate(gen):
                pass

    tasks = [asyncio.create_task(client()) for _ in range(running)]
    while session.snapshot().running < running:
        await asyncio.sleep(0.01)
    for _ in range(output_len // 2):  # stagger the finishes: a steady mix of ages
        await asyncio.sleep(0)
    # The counters are read together, between steps (the loop runs one task at a time).
    scheduled0, steps0 = executor.scheduled, executor.steps
    cpu0, exe0 = time.process_time(), executor.executor_seconds
    while executor.steps - steps0 < steps:
        await asyncio.sleep(0.001)
    cpu = time.process_time() - cpu0
    exe = executor.executor_seconds - exe0
    n = executor.steps - steps0
    scheduled = executor.scheduled - scheduled0
    stop.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if channel.failed:
        raise RuntimeError(f"{channel.failed} streamed sequences failed: the point measured errors")
    await engine.stop()
    session.leaving = True
    session._wake.set()
    return StepCost(
        running=running,
        steps=n,
        batch=scheduled / n,
        cpu_ms_per_step=1e3 * (cpu - exe) / n,
        cpu_us_per_request_step=1e6 * (cpu - exe) / scheduled,
        executor_ms_per_step=1e3 * exe / n,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: the test model)")
    p.add_argument("--running", default="16,64,256", help="comma-separated running requests")
    p.add_argument("--steps", type=int, default=300, help="steps measured per point")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--profile", default="", help="write a cProfile of the last point here")
    p.add_argument("--stream", action="store_true", help="streamed responses (SSE generator)")
    p.add_argument(
        "--tokens",
        action="store_true",
        help="streamed as --stream-writers serves them: token ids to a writer's frame",
    )
    p.add_argument("--json", default="")
    a = p.parse_args()
    model = a.model or model_dir()
    tokenizer = Tokenizer.from_model_dir(model)
    tune_gc()
    results = []
    print(f"{'running':>7} {'batch':>6} {'cpu_ms/step':>11} {'cpu_us/req':>10} {'exec_ms':>8}")
    for i, running in enumerate(int(x) for x in a.running.split(",")):
        prof = cProfile.Profile() if a.profile and i == len(a.running.split(",")) - 1 else None
        if prof:
            prof.enable()
        r = asyncio.run(
            measure_point(
                model, tokenizer, running, a.steps, a.input_len, a.output_len, a.stream, a.tokens
            )
        )
        if prof:
            prof.disable()
            prof.dump_stats(a.profile)
        gc.collect()
        results.append(r)
        print(
            f"{r.running:>7} {r.batch:>6.1f} {r.cpu_ms_per_step:>11.3f} "
            f"{r.cpu_us_per_request_step:>10.1f} {r.executor_ms_per_step:>8.3f}",
            flush=True,
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": vars(a), "points": [asdict(r) for r in results]}, f, indent=1)


if __name__ == "__main__":
    main()
