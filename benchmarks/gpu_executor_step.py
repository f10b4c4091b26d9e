"""The CUDA executor's whole decode step (``execute_model``: inputs, replay, sampling,
results), one step at a time and overlapped (executor_gpu.overlap), and where its host time
goes; part of benchmarks/gpu_step.py."""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch

from benchmarks.gpu_kernels import BLOCK
from common.wire.step_types import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    StepInput,
)
from executor_gpu.model_runner import GPUModelRunner


def start_requests(
    runner: GPUModelRunner, prompts: list[list[int]], step_id: int = 0, computed: int = 0
) -> list[int]:
    """Send ``prompts`` as new requests (``computed`` tokens already cached, the rest scheduled)
    on their own blocks; returns the sampled tokens."""
    per = -(-(max(map(len, prompts)) + 64) // BLOCK)
    new = [
        NewRequestData(
            f"r{i}",
            p,
            [],
            SamplingParams(),
            list(range(1 + i * per, 1 + (i + 1) * per)),
            computed,
            len(p) - computed,
        )
        for i, p in enumerate(prompts)
    ]
    out = runner.execute_model(StepInput(step_id, new_requests=new))
    return [o.sampled_token_id for o in out.outputs]


def decode_input(lengths: list[int], step_id: int) -> StepInput:
    """A decode step of every request (request i has ``lengths[i]`` tokens, the last one
    possibly still being sampled)."""
    cached = [CachedRequestData(f"r{i}", [], n - 1, 1) for i, n in enumerate(lengths)]
    return StepInput(step_id, cached_requests=cached)


def decode_step(runner: GPUModelRunner, lengths: list[int], step_id: int) -> list[int]:
    """One decode step of every request (request i has ``lengths[i]`` known tokens)."""
    out = runner.execute_model(decode_input(lengths, step_id))
    return [o.sampled_token_id for o in out.outputs]


def overlapped_decodes(
    runner: GPUModelRunner, prompts: list[list[int]], steps: int
) -> list[list[int]]:
    """Greedy tokens of ``prompts`` (a prefill step, then ``steps`` decode steps), each decode
    launched before the one before it is finished, as the servicer runs them with
    --overlap-steps (executor_gpu.overlap)."""
    runner.reset()
    outputs = [[t] for t in start_requests(runner, prompts)]

    def take(launched) -> None:
        for tokens, out in zip(outputs, runner.finish_step(launched).outputs):
            tokens.append(out.sampled_token_id)

    launched = runner.launch_step(decode_input([len(p) + 1 for p in prompts], 1))
    for step in range(2, steps + 1):  # step k decodes the token step k-1 is sampling
        following = runner.launch_step(decode_input([len(p) + step for p in prompts], step))
        take(launched)
        launched = following
    take(launched)
    return outputs


def time_executor_step(
    runner: GPUModelRunner,
    batch: int,
    context: int,
    steps: int,
    overlapped: bool = False,
    around=contextlib.nullcontext,
) -> float:
    """Median wall seconds per decode step: ``execute_model`` one step at a time (graphs
    replayed where captured), or each step launched before the previous one is finished, as
    the servicer runs them with --overlap-steps (executor_gpu.overlap): then the time between
    two finishes. ``around()`` is entered around the decode steps alone (a profiler)."""
    runner.reset()
    vocab = runner.geometry.vocab_size
    prompts = [[(7 * i + j) % vocab for j in range(context)] for i in range(batch)]
    times = []
    with torch.inference_mode():
        start_requests(runner, prompts, computed=context - 1)  # (finished: its tokens are here)
        with around():
            _decode_steps(runner, batch, context, steps, overlapped, times)
    runner.reset()
    return statistics.median(times[2:] or times)


def _decode_steps(runner, batch: int, context: int, steps: int, overlapped: bool, times) -> None:
    """Decode steps of every request, one at a time (``steps``) or overlapped (``steps`` + 1
    launches, ``steps`` timed); appends each step's wall seconds to ``times``."""
    if not overlapped:
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            decode_step(runner, [context + step] * batch, step)  # ends in a device->host copy
            times.append(time.perf_counter() - t0)
        return
    launched = runner.launch_step(decode_input([context + 1] * batch, 1))
    last = time.perf_counter()
    for step in range(2, steps + 2):  # step k decodes the token k-1 is sampling
        following = runner.launch_step(decode_input([context + step] * batch, step))
        runner.finish_step(launched)
        now = time.perf_counter()
        times.append(now - last)
        last, launched = now, following
    runner.finish_step(launched)


def compare_executor_steps(runner: GPUModelRunner, batch: int, context: int) -> dict:
    """The decode step one at a time against overlapped steps, alternating, three rounds each
    (medians of their medians, ms)."""
    rounds: dict[str, list[float]] = {"one_at_a_time_ms": [], "overlapped_ms": []}
    for _ in range(3):
        for key, overlapped in (("one_at_a_time_ms", False), ("overlapped_ms", True)):
            seconds = time_executor_step(runner, batch, context, 12, overlapped)
            rounds[key].append(seconds * 1e3)
    report = {key: statistics.median(values) for key, values in rounds.items()}
    report["rounds"] = rounds
    report["one_at_a_time_over_overlapped"] = report["one_at_a_time_ms"] / report["overlapped_ms"]
    return report


def profile_executor_step(runner: GPUModelRunner, batch: int, context: int) -> list[dict]:
    """Host time of ``execute_model`` decode steps by function (cProfile, 20 steps): where the
    whole step's time beyond the graph replay goes."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    time_executor_step(runner, batch, context, 20)
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = []
    for (path, line, name), (_, calls, tottime, cumtime, _) in stats.stats.items():
        rows.append(
            {
                "function": f"{os.path.basename(path)}:{line}:{name}",
                "calls": calls,
                "tottime_ms_per_step": tottime * 1e3 / 20,
                "cumtime_ms_per_step": cumtime * 1e3 / 20,
            }
        )
    return sorted(rows, key=lambda r: -r["tottime_ms_per_step"])[:25]


def profile_overlapped_steps(runner: GPUModelRunner, batch: int, context: int) -> dict:
    """The device's side of overlapped decode steps (CUPTI, 12 steps): wall ms per step, the
    device's busy ms per step (kernels and copies, which one stream runs one after another),
    and the largest kernels and copies by device time per step, graph replays' kernels
    included. Wall minus busy: the gaps between kernels, and the device waiting for the host."""
    from torch.profiler import ProfilerActivity, profile

    steps = 12
    launches = steps + 1  # overlapped: one launch ahead of the steps timed
    # (CUDA waits for the device on exit; on the CPU, for the smoke run, no device time)
    on_cuda = runner.device.type == "cuda"
    prof = profile(activities=[ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU])
    wall = time_executor_step(runner, batch, context, steps, overlapped=True, around=lambda: prof)
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    busy_us = sum(e.device_time_total for e in events) / launches
    rows = [
        {
            "kernel": e.key[:90],
            "calls": e.count / launches,
            "us_per_step": e.device_time_total / launches,
        }
        for e in events
    ]
    return {
        "wall_ms": wall * 1e3,
        "busy_ms": busy_us / 1e3,
        "kernels": sorted(rows, key=lambda r: -r["us_per_step"])[:30],
    }
