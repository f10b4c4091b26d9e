"""The simulated executor: its runner in-process, and a controller driving two of them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client import REGISTRY

from common.host.settings import ExecutorConfig
from common.wire.config import ModelGeometry
from common.wire.step_types import CachedRequestData, NewRequestData, SamplingParams, StepInput
from executor_sim.latency import LatencyModel
from executor_sim.runner import SimModelRunner
from executor_sim.sampler import FakeSampler
from executor_sim.worker import SimOptions, SimWorker
from tests.support.processes import (
    ROOT,
    free_port,
    spawn_controller,
    spawn_executor,
    wait_healthy_executors,
)
from tests.support.token_masks import pack_mask

EOS = 2
FIXED_MS = 2.0  # modeled milliseconds per step of the live sims


def make_runner(eos_prob: float = 0.0, vocab: int = 1000) -> SimModelRunner:
    geometry = ModelGeometry("m", "LlamaForCausalLM", vocab, 2, 1, 8, 256, [EOS])
    runner = SimModelRunner(
        ExecutorConfig(model="unused", block_size=4),
        geometry,
        FakeSampler(vocab, [EOS], eos_prob=eos_prob),
    )
    runner.load_model()
    runner.initialize_kv_cache(64)
    return runner


def new(
    rid: str,
    prompt: list[int],
    scheduled: int,
    blocks: int = 4,
    sampling: SamplingParams | None = None,
) -> NewRequestData:
    return NewRequestData(
        rid, prompt, [], sampling or SamplingParams(), list(range(1, blocks + 1)), 0, scheduled
    )


def test_runner_samples_only_when_the_known_tokens_are_computed():
    runner = make_runner()
    prompt = [5, 6, 7, 8, 9, 10]
    out = runner.execute_model(StepInput(1, new_requests=[new("a", prompt, 4), new("b", [3], 1)]))
    assert [o.request_id for o in out.outputs] == ["a", "b"]
    assert out.outputs[0].sampled_token_id is None  # chunked prefill, 2 prompt tokens left
    assert out.outputs[1].sampled_token_id is not None
    out = runner.execute_model(
        StepInput(
            2, cached_requests=[CachedRequestData("b", [], 1, 1), CachedRequestData("a", [], 4, 2)]
        )
    )
    assert [o.request_id for o in out.outputs] == ["b", "a"]
    assert all(o.sampled_token_id is not None and not o.error for o in out.outputs)
    assert runner.last_shape.num_tokens == 3 and runner.last_shape.num_sampled == 2
    assert len(runner.requests["a"].token_ids) == len(prompt) + 1


def test_runner_greedy_is_a_function_of_the_prompt_and_never_samples_eos():
    first, second = make_runner(), make_runner()
    tokens = []
    for runner in (first, second):
        ids = []
        runner.execute_model(StepInput(1, new_requests=[new("x", [11, 12, 13], 3, blocks=16)]))
        for step in range(2, 40):
            known = len(runner.requests["x"].token_ids)
            out = runner.execute_model(
                StepInput(step, cached_requests=[CachedRequestData("x", [], known - 1, 1)])
            )
            ids.append(out.outputs[0].sampled_token_id)
        tokens.append(ids)
    assert tokens[0] == tokens[1] and EOS not in tokens[0]


def test_runner_respects_min_tokens_and_reports_errors():
    runner = make_runner(eos_prob=1.0)  # ends as soon as it may
    sampling = SamplingParams(min_tokens=3, stop_token_ids=[EOS, 7])
    runner.execute_model(StepInput(1, new_requests=[new("s", [4, 5], 2, sampling=sampling)]))
    for step in range(2, 6):
        known = len(runner.requests["s"].token_ids)
        runner.execute_model(
            StepInput(step, cached_requests=[CachedRequestData("s", [], known - 1, 1)])
        )
    sampled = runner.requests["s"].token_ids[2:]
    assert all(t not in (EOS, 7) for t in sampled[:3]) and sampled[3] in (EOS, 7)
    out = runner.execute_model(
        StepInput(
            9,
            new_requests=[new("big", [1] * 20, 20, blocks=2)],
            cached_requests=[CachedRequestData("ghost", [], 0, 1)],
        )
    )
    assert [bool(o.error) for o in out.outputs] == [True, True]
    assert "big" not in runner.requests


def test_runner_logprobs_have_the_asked_shape():
    runner = make_runner()
    sampling = SamplingParams(logprobs=3, prompt_logprobs=2)
    out = runner.execute_model(
        StepInput(1, new_requests=[new("l", [4, 5, 6, 7], 4, sampling=sampling)])
    )
    o = out.outputs[0]
    assert o.logprobs is not None and o.logprobs.token_id == o.sampled_token_id
    assert len(o.logprobs.top_token_ids) == 3 and o.logprobs.rank == 1
    assert [lp.token_id for lp in o.prompt_logprobs] == [5, 6, 7]
    assert all(len(lp.top_logprobs) == 2 for lp in o.prompt_logprobs)


def _decode_masked(runner, rid, masks, sampling=None, prompt=(4, 5, 6)):
    """Run ``rid`` one token per mask (None: unconstrained); its sampled tokens."""
    first = new(rid, list(prompt), len(prompt), blocks=8, sampling=sampling)
    first.allowed_token_mask = masks[0]
    outs = [runner.execute_model(StepInput(1, new_requests=[first])).outputs[0]]
    for step, mask in enumerate(masks[1:], start=2):
        known = len(runner.requests[rid].token_ids)
        cached = CachedRequestData(rid, [], known - 1, 1, mask)
        outs.append(runner.execute_model(StepInput(step, cached_requests=[cached])).outputs[0])
    assert not any(o.error for o in outs)
    return [o.sampled_token_id for o in outs], outs


def test_runner_samples_only_allowed_tokens_deterministically():
    """Its usual token when allowed, else the first allowed at or after it (wrapping); the same
    inputs give the same output; seeded and unseeded random requests obey the mask too."""
    free, _ = _decode_masked(make_runner(), "g", [None] * 4)
    usual = pack_mask(free[:2], 1000)  # allows the usual tokens of steps 1-2
    masks = [usual, usual, pack_mask([free[2] + 1, 3], 1000), pack_mask([0], 1000)]
    got, _ = _decode_masked(make_runner(), "g", masks)
    assert got == [free[0], free[1], free[2] + 1 if free[2] + 1 < 1000 else 3, 0]
    wrap = pack_mask([1], 1000)  # below every usual token: wraps around to it
    for sampling in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, seed=5)):
        tokens, _ = _decode_masked(
            make_runner(), "r", [wrap, pack_mask([998, 999], 1000)], sampling
        )
        assert tokens[0] == 1 and tokens[1] in (998, 999)


def test_runner_ends_only_when_the_grammar_allows_nothing_else():
    """Ending ids are avoided while the mask allows other tokens (even before min_tokens would
    allow them), and taken when the grammar allows only them; logprobs stay allowed."""
    runner = make_runner(eos_prob=1.0)  # would end at once if it could
    sampling = SamplingParams(min_tokens=0, logprobs=5)
    masks = [pack_mask([EOS, 40, 41], 1000), pack_mask([EOS], 1000)]
    tokens, outs = _decode_masked(runner, "e", masks, sampling)
    assert tokens[1] == EOS
    assert set(outs[0].logprobs.top_token_ids) <= {EOS, 40, 41}
    assert len(outs[0].logprobs.top_token_ids) == 3  # as many as the grammar allows
    assert outs[1].logprobs.top_token_ids == [EOS]
    runner = make_runner()
    tokens, _ = _decode_masked(runner, "f", [pack_mask([EOS, 40, 41], 1000)])
    assert tokens[0] in (40, 41)


def test_runner_fails_a_bad_mask_alone():
    runner = make_runner()
    bad = new("bad", [4, 5], 2)
    bad.allowed_token_mask = bytes(125)  # 1000 tokens take 128 bytes
    out = runner.execute_model(StepInput(1, new_requests=[bad, new("ok", [4, 5], 2)]))
    assert "holds 125 bytes, not 128" in out.outputs[0].error
    assert out.outputs[1].sampled_token_id is not None and "bad" not in runner.requests


def test_latency_model():
    model = LatencyModel(fixed_s=0.01, per_token_s=1e-4, per_request_s=1e-3)
    assert model.seconds(10, 2) == pytest.approx(0.01 + 1e-3 + 2e-3)


def test_worker_sleeps_the_modeled_time_and_counts(default_model_dir):
    options = SimOptions(latency=LatencyModel(fixed_s=0.005, per_token_s=0.0), num_blocks=100)
    worker = SimWorker(ExecutorConfig(model=default_model_dir), options)
    worker.init_device()
    worker.load_model()
    assert worker.determine_available_memory().available_kv_bytes == (
        100 * worker.get_kv_cache_spec().bytes_per_block
    )
    worker.initialize_cache(100)
    steps = REGISTRY.get_sample_value("tandem_sim:steps_total")
    out = worker.execute_model(StepInput(1, new_requests=[new("w", [1, 2, 3], 3)]))
    assert out.device_seconds >= 0.005 and out.outputs[0].sampled_token_id is not None
    assert REGISTRY.get_sample_value("tandem_sim:steps_total") == steps + 1


def test_step_size_probe_forgets_steps_that_never_run():
    from common.wire import convert
    from executor_sim import metrics

    metrics.install_step_size_probe()
    message = convert.step_to_pb(StepInput(7, new_requests=[new("p", [1, 2, 3], 3)]))
    decoded = []
    for step_id in range(metrics._MAX_PENDING_SIZES + 200):  # decoded ahead, never run
        message.step_id = step_id
        decoded.append(convert.step_from_pb(message))
    assert len(metrics._sizes) <= metrics._MAX_PENDING_SIZES
    assert metrics.take_step_bytes(decoded[0]) == 0  # forgotten
    assert metrics.take_step_bytes(decoded[-1]) == message.ByteSize()
    assert metrics.take_step_bytes(decoded[-1]) == 0


def test_sim_imports_no_torch():
    code = "import sys, executor_sim.__main__; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# --- live: a controller in front of two simulated executors ---------------------------------


def sim_counters(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("tandem_sim:")
    }


@pytest.fixture(scope="module")
def sim_fleet(default_model_dir, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("sim"))
    procs, metric_ports, addresses = [], [], []
    for i in range(2):
        metrics_port = free_port()
        proc, port = spawn_executor(
            "executor_sim",
            default_model_dir,
            tmp,
            f"sim{i}",
            extra=[
                "--metrics-port",
                str(metrics_port),
                "--num-blocks",
                "512",
                "--step-fixed-ms",
                str(FIXED_MS),
                "--step-per-token-us",
                "10",
            ],
        )
        procs.append(proc)
        metric_ports.append(metrics_port)
        addresses += ["--executor", f"127.0.0.1:{port}"]
    server = spawn_controller(default_model_dir, tmp, addresses)
    server.executors.extend(procs)
    try:
        wait_healthy_executors(server, 2, timeout=120)
        yield server, metric_ports
    finally:
        server.stop()


def test_completions_through_sim_executors(sim_fleet):
    server, _ = sim_fleet
    client = server.client(timeout=60)
    resp = client.completions.create(
        model=server.model_name,
        prompt=["Hello", "The sky is"],
        max_tokens=12,
        temperature=0,
        n=2,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert len(resp.choices) == 4
    for choice in resp.choices:
        assert choice.finish_reason == "length"
        assert len(choice.model_extra["token_ids"]) == 12
    # Each prompt counts once, whatever n.
    prompt_tokens = sum(len(resp.choices[i].model_extra["prompt_token_ids"]) for i in (0, 2))
    assert resp.usage.completion_tokens == 48
    assert resp.usage.prompt_tokens == prompt_tokens
    assert resp.usage.total_tokens == prompt_tokens + 48
    # Greedy output is a function of the prompt, whichever executor runs it.
    again = client.completions.create(
        model=server.model_name,
        prompt="Hello",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert again.choices[0].text == resp.choices[0].text


def test_streaming_chat_and_logprobs(sim_fleet):
    server, _ = sim_fleet
    client = server.client(timeout=60)
    stream = client.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    usage, logprobs = None, []
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.logprobs and choice.logprobs.content:
                logprobs += choice.logprobs.content
    assert usage is not None and usage.completion_tokens == 9
    assert len(logprobs) == 9 and all(len(lp.top_logprobs) == 2 for lp in logprobs)


def test_sim_metrics_count_steps_busy_time_and_bytes(sim_fleet):
    server, metric_ports = sim_fleet
    before = [sim_counters(p) for p in metric_ports]
    client = server.client(timeout=60)
    resp = client.completions.create(
        model=server.model_name,
        prompt="Count me",
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert resp.usage.completion_tokens == 20
    server.wait_idle()
    after = [sim_counters(p) for p in metric_ports]

    def delta(name: str) -> float:
        return sum(a[name] - b[name] for a, b in zip(after, before))

    steps = delta("tandem_sim:steps_total")
    assert steps >= 20
    assert delta("tandem_sim:sampled_tokens_total") >= 20
    assert delta("tandem_sim:busy_seconds_total") >= 0.9 * steps * FIXED_MS / 1e3
    assert delta("tandem_sim:step_request_bytes_total") > 0
    assert delta("tandem_sim:decode_steps_total") >= 18
    assert all(e["used_blocks"] == 0 for e in server.executors_state())


def test_a_client_that_leaves_a_non_streamed_request_aborts_it(sim_fleet):
    server, _ = sim_fleet
    body = {
        "model": server.model_name,
        "prompt": "wait for me",
        "max_tokens": 4000,
        "ignore_eos": True,
    }

    def aborted() -> float:
        text = httpx.get(server.base_url + "/metrics").text
        return sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line
        )

    before = aborted()
    with pytest.raises(httpx.TimeoutException):  # the client gives up and closes the socket
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + 10
    while aborted() == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert aborted() == before + 1  # at once, not when its 4000 tokens would have been done
    with open(os.path.join(server.log_dir, "controller.log")) as f:
        log = f.read()
    assert "Traceback" not in log  # a client leaving is routine, not an application error


def _step_token_buckets(base_url: str) -> dict[str, float]:
    """vllm:iteration_tokens_total bucket counts by upper bound, summed over executors."""
    counts: dict[str, float] = {}
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:iteration_tokens_total_bucket{"):
            le = line.split('le="')[1].split('"')[0]
            counts[le] = counts.get(le, 0.0) + float(line.split()[-1])
    return counts


def test_a_slow_executor_gets_steps_sized_to_the_step_time_target(default_model_dir, tmp_path):
    """A simulated device at 1 ms per token (a 2048-token step would take 2 s): with a 0.3 s
    target the controller cuts a 1500-token prompt into steps of at most ~300 tokens, by the
    step cost it measures; greedy output is unchanged by the chunking."""
    tmp = str(tmp_path)
    proc, port = spawn_executor(
        "executor_sim",
        default_model_dir,
        tmp,
        "slow",
        extra=[
            "--num-blocks",
            "512",
            "--step-fixed-ms",
            "5",
            "--step-per-token-us",
            "1000",
            "--device-kind",
            "cpu",
        ],
    )
    server = spawn_controller(
        default_model_dir, tmp, ["--executor", f"127.0.0.1:{port}", "--step-time-target", "0.3"]
    )
    server.executors.append(proc)
    try:
        wait_healthy_executors(server, 1, timeout=120)
        client = server.client(timeout=120)
        prompt = list(range(100, 1600))  # 1500 token ids
        resp = client.completions.create(
            model=server.model_name,
            prompt=prompt,
            max_tokens=4,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert resp.usage.prompt_tokens == 1500 and resp.usage.completion_tokens == 4
        buckets = _step_token_buckets(server.base_url)
        steps = buckets["+Inf"]
        assert steps >= 5  # at least 1500 / 300 prefill steps, then decodes
        assert buckets["500.0"] == steps  # no step over 500 tokens (the budget is 2048)
        server.wait_idle()
        assert all(e["used_blocks"] == 0 for e in server.executors_state())
    finally:
        server.stop()


def test_idle_http_connections_are_kept_past_proxy_idle_timeouts(sim_fleet):
    """A proxy in front reuses idle upstream connections for up to its own idle timeout (60 s
    is common); the controller must not close one first (uvicorn's default: after 5 s), or the
    proxy's next request on it fails with a reset."""
    import http.client
    from urllib.parse import urlsplit

    server, _ = sim_fleet
    url = urlsplit(server.base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    try:
        conn.request("GET", "/health")
        assert conn.getresponse().read()
        sock = conn.sock
        time.sleep(6)
        conn.request("GET", "/health")  # on the same socket, idle for 6 s
        response = conn.getresponse()
        assert response.status == 200 and response.read()
        assert conn.sock is sock
    finally:
        conn.close()
