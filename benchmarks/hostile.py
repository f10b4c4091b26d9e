"""What hostile requests and clients cost a running server: time to answer, controller RSS
growth, executor losses, and whether an ordinary greedy request is still served unchanged.

Runs against any Tandem controller (this tree's or an older one, to compare before and after):
give its URL and the controller's pid (RSS and open descriptors are read from /proc), on this
machine. Each case is one class of hostile input; the report is one row per case:

    python benchmarks/hostile.py --url http://127.0.0.1:8000 --pid 1234 --json /tmp/h.json

Cases: a seed at int64's top with n=2 (overflow on the wire), one 40,000-character stop string
with n=16, 300,000 one-token prompts with n=16, a model name that cannot be encoded (and the
next request on that keep-alive connection), temperature 1e-39, a stalled reader (a stream
never read for --stall-seconds), and --idle-connections half-open connections that send
nothing (how many are still open after --idle-seconds, and an ordinary request meanwhile).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.e2e.helpers import metric_sum  # noqa: E402
from tests.support.processes import PeakRSS  # noqa: E402

INT64_MAX = 2**63 - 1
GREEDY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


@dataclass
class CaseResult:
    """One hostile case's cost, as the server showed it."""

    case: str  # what was sent
    status: str  # the HTTP status (or the client's error) of the hostile request
    seconds: float  # until the hostile request was answered (or given up)
    rss_growth_mib: float  # peak controller RSS during the case minus before it
    executor_losses: float  # growth of tandem:executor_lost_total during the case
    greedy_same: bool  # an ordinary greedy request afterwards gave the reference text
    note: str  # what else was seen


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def metric(url: str, name: str) -> float:
    """A metric of the server's /metrics, summed over its labels."""
    return metric_sum(httpx.get(url + "/metrics", timeout=30).text, name)


def losses(url: str) -> float:
    return metric(url, "tandem:executor_lost_total")


def greedy_text(url: str, model: str) -> str:
    body = dict(GREEDY, model=model)
    return httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]


def post(url: str, body: dict | bytes, timeout: float) -> str:
    try:
        if isinstance(body, bytes):
            headers = {"content-type": "application/json"}
            r = httpx.post(url, content=body, headers=headers, timeout=timeout)
        else:
            r = httpx.post(url, json=body, timeout=timeout)
        return str(r.status_code)
    except httpx.HTTPError as exc:
        return f"client error: {type(exc).__name__}"


def case_seed(url: str, model: str, timeout: float) -> tuple[str, str]:
    body = {"model": model, "prompt": "hi", "n": 2, "seed": INT64_MAX, "max_tokens": 2}
    return post(url + "/v1/completions", body, timeout), ""


def case_stop(url: str, model: str, timeout: float) -> tuple[str, str]:
    body = {"model": model, "prompt": "hi", "n": 16, "max_tokens": 2, "stop": ["ab" * 20000]}
    return post(url + "/v1/completions", body, timeout), ""


def case_prompts(url: str, model: str, timeout: float) -> tuple[str, str]:
    head = json.dumps({"model": model, "n": 16, "max_tokens": 1})[:-1]
    raw = (head + ', "prompt": [').encode()
    raw += b",".join([b"[1]"] * 300_000) + b"]}"
    return post(url + "/v1/completions", raw, timeout), f"body {len(raw) / 1e6:.1f} MB"


def case_model_name(url: str, model: str, timeout: float) -> tuple[str, str]:
    raw = b'{"model": "\\ud800", "prompt": "hi", "max_tokens": 1}'
    with httpx.Client(timeout=timeout) as http:  # one keep-alive connection
        try:
            first = str(http.post(url + "/v1/completions", content=raw).status_code)
        except httpx.HTTPError as exc:
            first = f"client error: {type(exc).__name__}"
        try:
            body = dict(GREEDY, model=model)
            after = str(http.post(url + "/v1/completions", json=body).status_code)
        except httpx.HTTPError as exc:
            after = f"client error: {type(exc).__name__}"
    return first, f"next request on the connection: {after}"


def case_temperature(url: str, model: str, timeout: float) -> tuple[str, str]:
    body = dict(GREEDY, model=model, temperature=1e-39)
    try:
        r = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
    except httpx.HTTPError as exc:
        return f"client error: {type(exc).__name__}", ""
    text = r.json()["choices"][0]["text"] if r.status_code == 200 else ""
    return str(r.status_code), f"text {text!r} vs greedy {greedy_text(url, model)!r}"


def make_stall_case(seconds: float) -> Callable[[str, str, float], tuple[str, str]]:
    def case_stall(url: str, model: str, timeout: float) -> tuple[str, str]:
        """A stream whose client reads its headers, then nothing: is it aborted?"""
        host, port = url.split("//", 1)[1].split(":")
        body = json.dumps(
            {
                "model": model,
                "prompt": "Tell me a long story.",
                "max_tokens": 4000,
                "stream": True,
                "ignore_eos": True,
                "logprobs": 20,
            }
        ).encode()
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        sock.recv(1024)
        time.sleep(seconds)
        running = metric(url, "vllm:num_requests_running")
        sock.close()
        return "stream", f"requests running after {seconds:.0f}s unread: {running:.0f}"

    return case_stall


def make_idle_case(count: int, seconds: float, pid: int) -> Callable[[str, str, float], tuple]:
    def case_idle(url: str, model: str, timeout: float) -> tuple[str, str]:
        host, port = url.split("//", 1)[1].split(":")
        fds_before = open_fds(pid)
        socks = []
        for _ in range(count):
            try:
                socks.append(socket.create_connection((host, int(port)), timeout=5))
            except OSError:
                break
        started = time.monotonic()
        try:
            served = post(url + "/v1/completions", dict(GREEDY, model=model), 60)
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            served = repr(exc)
        answered = time.monotonic() - started
        time.sleep(max(0.0, seconds - answered))
        held = open_fds(pid) - fds_before
        for sock in socks:
            sock.close()
        return (
            f"{len(socks)} opened",
            f"ordinary request meanwhile: {served} in {answered:.2f}s; "
            f"controller descriptors still held after {seconds:.0f}s: {held}",
        )

    return case_idle


def run_case(name: str, fn, url: str, model: str, pid: int, timeout: float) -> CaseResult:
    lost_before = losses(url)
    reference = greedy_text(url, model)
    started = time.monotonic()
    with PeakRSS(pid, interval=0.05) as rss:
        status, note = fn(url, model, timeout)
        seconds = time.monotonic() - started
        time.sleep(1.0)
    same = greedy_text(url, model) == reference
    return CaseResult(
        name,
        status,
        round(seconds, 2),
        round(rss.peak - rss.base, 1),
        losses(url) - lost_before,
        same,
        note,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--pid", type=int, required=True, help="the controller's process id")
    parser.add_argument("--timeout", type=float, default=90.0, help="client timeout per case")
    parser.add_argument("--stall-seconds", type=float, default=40.0)
    parser.add_argument("--idle-connections", type=int, default=1000)
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--cases", default="", help="comma-separated case names (default all)")
    parser.add_argument("--json", default="", help="write the rows here")
    args = parser.parse_args()
    model = httpx.get(args.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    cases = {
        "seed_int64_max_n2": case_seed,
        "stop_40000_chars_n16": case_stop,
        "prompts_300000_n16": case_prompts,
        "model_lone_surrogate": case_model_name,
        "temperature_1e-39": case_temperature,
        "stalled_reader": make_stall_case(args.stall_seconds),
        "idle_connections": make_idle_case(args.idle_connections, args.idle_seconds, args.pid),
    }
    chosen = [c for c in args.cases.split(",") if c] or list(cases)
    rows = []
    for name in chosen:
        row = run_case(name, cases[name], args.url, model, args.pid, args.timeout)
        rows.append(row)
        print(json.dumps(asdict(row)), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([asdict(r) for r in rows], handle, indent=1)


if __name__ == "__main__":
    main()
