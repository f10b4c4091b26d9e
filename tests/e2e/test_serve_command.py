"""`python -m tandem serve` end to end: the controller and a GPU executor (on the CPU here) as
its children serve the default model to the official openai client, and SIGTERM stops them
all with status 0."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai

from tests.support.processes import DEFAULT_MODEL_DIR, free_port, spawn_serve, wait_until


def group_members(pgid: int) -> list[int]:
    """Live processes of a process group (zombies excluded)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, group = fields[0], int(fields[2])
        if group == pgid and state != "Z":
            members.append(int(entry))
    return members


def test_serve_answers_a_chat_and_stops_on_sigterm(default_model_dir, tmp_path):
    port, executor_port = free_port(), free_port()
    argv = ["--port", str(port), "--executor-port", str(executor_port)]
    argv += ["--executor-step-port", str(free_port())]
    argv += [f"--executor-args=--kv-cache-bytes {256 * 2**20}"]
    if os.path.realpath(default_model_dir) != os.path.realpath(DEFAULT_MODEL_DIR):
        argv += ["--model", default_model_dir]  # else: serve's own default, unnamed
    log_path = tmp_path / "serve.log"
    serve = spawn_serve(argv, str(log_path))
    base = f"http://127.0.0.1:{port}"

    def state() -> str:
        if serve.poll() is not None:
            return "exited"
        return "healthy" if httpx.get(base + "/health", timeout=2).status_code == 200 else ""

    try:
        reached = wait_until(state, 600, "tandem serve healthy", logs=str(tmp_path))
        assert reached == "healthy", log_path.read_text()[-3000:]
        children = [p for p in group_members(serve.pid) if p != serve.pid]
        assert len(children) >= 2  # the controller and the executor
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model=os.path.basename(default_model_dir.rstrip("/")),
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8,
            temperature=0,
        )
        assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
        executors = httpx.get(base + "/admin/executors", timeout=10).json()["executors"]
        assert [e["step_transport"] for e in executors] == ["socket"]  # serve's default
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=120) == 0, log_path.read_text()[-3000:]
        deadline = time.time() + 10
        while group_members(serve.pid) and time.time() < deadline:
            time.sleep(0.2)
        assert group_members(serve.pid) == []  # no child outlives serve
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
