"""Overlapped steps (executor_gpu.overlap): step N+1 launched before step N is finished, its
decodes computing N's sampled tokens through placeholders filled in on the device.

On the CPU a launch runs the step whole, but everything that decides correctness is the same
as on CUDA: placeholders left and filled, the results' copy, the order of outputs, a request
that fails while the next step already holds it, penalties that wait for the results. These
tests force the overlap on and hold it to transformers and to the same runner one step at a
time.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from common.torch.runner import TorchModelRunner  # noqa: E402
from common.wire.step_types import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    StepInput,
)
from executor_gpu.model_runner import GPUModelRunner  # noqa: E402
from executor_gpu.overlap import fill_placeholders  # noqa: E402
from tests.support.cpu_runner import cpu_runner, runner_device  # noqa: E402
from tests.support.mini_controller import MiniController  # noqa: E402
from tests.support.tiny_models import hf_greedy, random_prompts, save_tiny_checkpoint  # noqa: E402


def prompts_of(seed: int, lengths: list[int]) -> list[list[int]]:
    """Random prompts without token 0 (transformers' generate would take it for padding)."""
    return [[t or 1 for t in p] for p in random_prompts(seed, lengths)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-overlap"))
    hf = save_tiny_checkpoint("qwen3", path)
    return path, hf


def make_runner(path: str, overlap: str = "on", graphs: bool = False) -> GPUModelRunner:
    return cpu_runner(path, graphs=graphs, overlap_steps=overlap)


def test_the_overlap_is_on_for_cuda_and_forced_on_the_cpu(tiny):
    path, _ = tiny
    assert make_runner(path, "on").overlaps_steps
    # auto: on for CUDA (one rank), one step at a time on the CPU
    assert make_runner(path, "auto").overlaps_steps == (runner_device() == "cuda")
    assert not make_runner(path, "off").overlaps_steps


def test_placeholders_are_filled_from_the_step_in_flight():
    ids = torch.tensor([5, -1, 7, -3, -2])
    assert fill_placeholders(ids, torch.tensor([40, 41, 42])).tolist() == [5, 40, 7, 42, 41]
    history = torch.tensor([[3, -2, 9], [-1, 9, 9]])  # penalty rows' histories, padded
    assert fill_placeholders(history, torch.tensor([40, 41])).tolist() == [[3, 41, 9], [40, 9, 9]]
    with pytest.raises(RuntimeError, match="no step that samples is in flight"):
        fill_placeholders(ids, None)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "replay"])
def test_overlapped_greedy_matches_transformers(tiny, graphs):
    path, hf = tiny
    runner = make_runner(path, graphs=graphs)
    prompts = prompts_of(3, [5, 19, 33, 8])
    ctl = MiniController(runner, budget=40)
    reqs = [ctl.add(f"r{i}", p, max_tokens=6 + 3 * i) for i, p in enumerate(prompts)]
    overlapped = ctl.run_overlapped()
    assert overlapped >= 15  # most steps were launched with another in flight
    for req, prompt in zip(reqs, prompts):
        assert req.output == hf_greedy(hf, prompt, req.max_tokens)
    assert not runner.input_batch.requests  # every request finished and was let go


def _run(runner, overlapped: bool, sampling: list[SamplingParams], prompts) -> list:
    runner.reset()
    ctl = MiniController(runner, budget=64)
    reqs = [
        ctl.add(f"r{i}", p, s, max_tokens=10) for i, (p, s) in enumerate(zip(prompts, sampling))
    ]
    if overlapped:
        ctl.run_overlapped()
    else:
        ctl.run()
    return [(r.output, r.logprobs) for r in reqs]


def test_sampling_logprobs_and_penalties_match_one_step_at_a_time(tiny):
    path, _ = tiny
    runner = make_runner(path)
    prompts = prompts_of(5, [7, 12, 9, 15])
    sampling = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=11, logprobs=3),
        SamplingParams(temperature=0.8, logprobs=2),  # unseeded: the executor's generator
        SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, logprobs=0, min_tokens=4, stop_token_ids=[3]),
    ]
    needs, in_flight = [], []
    original = runner.step_needs_results

    def recording(step):
        needs.append(original(step))
        # What a runner reading histories on the host would say: a penalty row's history
        # ends in a token still being sampled.
        in_flight.append(TorchModelRunner.step_needs_results(runner, step))
        return needs[-1]

    runner.step_needs_results = recording
    stepped = _run(runner, False, sampling, prompts)
    overlapped = _run(runner, True, sampling, prompts)
    assert overlapped == stepped
    # The penalized request's history held tokens in flight, filled in on the device: no step
    # had to wait for them.
    assert any(in_flight)
    assert needs and not any(needs)


def _new(rid, prompt, blocks, n):
    return NewRequestData(rid, prompt, [], SamplingParams(), blocks, 0, n)


def test_a_request_that_fails_while_the_next_step_holds_it_fails_alone(tiny):
    path, hf = tiny
    runner = make_runner(path)
    good, bad = prompts_of(9, [6, 6])
    step0 = StepInput(0, new_requests=[_new("good", good, [1], 6), _new("bad", bad, [2], 6)])
    runner.finish_step(runner.launch_step(step0))
    # The bad request's cached keys turn NaN: its next decode's hidden state is not finite.
    for cache in runner.kv_caches:
        cache[:, 2, :6] = float("nan")
    decode = [CachedRequestData("good", [], 6, 1), CachedRequestData("bad", [], 6, 1)]
    step1 = runner.launch_step(StepInput(1, cached_requests=decode))
    decode = [CachedRequestData("good", [], 7, 1), CachedRequestData("bad", [], 7, 1)]
    step2 = runner.launch_step(StepInput(2, cached_requests=decode))  # before step 1 finishes
    out1 = runner.finish_step(step1)
    out2 = runner.finish_step(step2)
    assert [o.error for o in out1.outputs] == ["", "non-finite values in the forward"]
    assert [o.error for o in out2.outputs] == ["", "unknown request"]
    assert "bad" not in runner.input_batch.requests
    # Both steps' slots of the bad request were zeroed; the good one goes on as transformers.
    for cache in runner.kv_caches:
        assert torch.all(cache[:, 2, 6:8] == 0)
    assert not runner.finish_step(runner.launch_step(StepInput(3))).outputs  # an empty step
    tokens = [o.sampled_token_id for o in (out1.outputs[0], out2.outputs[0])]
    assert tokens == hf_greedy(hf, good, 3)[1:]


def test_a_launch_leaves_placeholders_that_its_finish_replaces(tiny):
    path, _ = tiny
    runner = make_runner(path)
    (prompt,) = prompts_of(4, [5])
    launched = runner.launch_step(StepInput(0, new_requests=[_new("a", prompt, [1], 5)]))
    state = runner.input_batch.requests["a"]
    assert state.token_ids == prompt + [-1]
    decode = StepInput(1, cached_requests=[CachedRequestData("a", [], 5, 1)])
    assert not runner.step_needs_results(decode)  # no penalties: its token can stay on the device
    out = runner.finish_step(launched)
    assert state.token_ids == prompt + [out.outputs[0].sampled_token_id]
