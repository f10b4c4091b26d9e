"""The haproxy configuration in front of several controllers (`tandem serve --controllers N`).

Every controller serves the full API, so haproxy only has to pick a live one and hide a
controller that restarts or dies from the clients where that is safe. Each directive below
says why it is there; docs/operations.md ("Several controllers behind a load balancer") gives
the behaviour a client sees.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Backend:
    """One controller behind the balancer."""

    name: str  # haproxy's server name (also sent back in the X-Tandem-Controller header)
    address: str  # host:port of its HTTP API


@dataclass
class BalancerOptions:
    """What the generated haproxy.cfg says; the defaults are what `make fleet` uses."""

    bind: str  # host:port the clients reach
    backends: list[Backend]  # the controllers
    stats_socket: str  # haproxy's admin socket (`show stat`: each server's UP/DOWN)
    check_interval_ms: int = 1000  # GET /health every second on each controller...
    check_fall: int = 2  # ...DOWN after 2 failed checks (a dead one is out within ~2 s)...
    check_rise: int = 1  # ...UP again after 1 good one (a restarted one takes work at once)
    # A controller that accepts no connection within this is skipped. haproxy also waits
    # min(this, 1 s) before retrying a failed connection under leastconn, so it is short: a
    # connection to a live controller is the kernel's work, not the process's.
    connect_timeout_ms: int = 500
    # Inactivity bound on a response: a non-streamed completion sends nothing until it ends, so
    # this is long; the controller bounds a request's own time (its limits and its timeouts).
    server_timeout_s: int = 3600
    client_timeout_s: int = 3600  # the same bound on the client side (an SSE stream reads only)
    retries: int = 3  # L7 retries of one request (each on another controller: redispatch 1)
    # Request bodies up to this size are buffered whole, so a POST can be replayed on another
    # controller. The controller accepts up to --max-request-bytes (4 MiB), but haproxy's buffer
    # size is per buffer of every connection (a request and a response one each), so it is
    # bounded far below that: 64 KiB holds a prompt of roughly 15,000 tokens as text; a larger
    # body is forwarded as it arrives and is only retried while no byte of it was sent.
    buffer_bytes: int = 64 * 1024
    maxconn: int = 4096  # concurrent client connections (each may hold two buffers)
    hard_stop_s: int = 60  # after a soft stop (SIGUSR1), streams still open are cut then
    extra_global: list[str] = field(default_factory=list)  # more lines for `global` (tests)


def render(options: BalancerOptions) -> str:
    """haproxy.cfg for ``options`` (checked by `haproxy -c` before it is used)."""
    return "\n".join([*_global(options), *_defaults(options), *_frontend(options)]) + "\n"


def _global(o: BalancerOptions) -> list[str]:
    return [
        "global",
        # Runs in the foreground (-db) under the launcher: no daemon, no pid file, no chroot.
        f"    maxconn {o.maxconn}",
        f"    tune.bufsize {o.buffer_bytes}",
        # The launcher and the tests read each server's state here (`show stat`).
        f"    stats socket {o.stats_socket} mode 600 level admin",
        # A soft stop waits for open streams (the controllers drain theirs first), not forever.
        f"    hard-stop-after {o.hard_stop_s}s",
        # No log section: in the foreground haproxy writes its warnings (a server going DOWN
        # or UP, with the reason) to stderr itself, which the launcher passes through.
        *(f"    {line}" for line in o.extra_global),
        "",
    ]


def _defaults(o: BalancerOptions) -> list[str]:
    return [
        "defaults",
        "    mode http",
        f"    timeout connect {o.connect_timeout_ms}ms",
        f"    timeout client {o.client_timeout_s}s",
        f"    timeout server {o.server_timeout_s}s",
        # A stream that upgrades (none does today) keeps the same long bound.
        f"    timeout tunnel {o.server_timeout_s}s",
        "    timeout http-request 30s",  # a client must send its headers and body within 30 s
        "    timeout http-keep-alive 60s",
        "    timeout queue 30s",  # every controller at maxconn: wait this long, then 503
        f"    timeout check {o.check_interval_ms}ms",  # a hung (SIGSTOPped) one fails its check
        # L7 retries, only where the request cannot have produced anything a client saw:
        # conn-failure (no connection: a controller gone or restarting), empty-response (the
        # connection closed with no byte of answer: a controller killed mid-request; the
        # completion is computed again elsewhere, which has no effect beyond the work), 503
        # (not admitted: a controller draining for a restart, or without executors).
        f"    retries {o.retries}",
        "    retry-on conn-failure empty-response 503",
        # Each retry goes to another controller, not the one that just failed.
        "    option redispatch 1",
        # A retry replays the request, so its body must be buffered whole (up to tune.bufsize).
        "    option http-buffer-request",
        # haproxy's own answers (no controller up, a controller failing after its retries, a
        # timeout) in the OpenAI error shape the controllers use, which clients parse.
        *(_error(status, code, message) for status, code, message in HAPROXY_ERRORS),
        "",
    ]


HAPROXY_ERRORS = [  # (status, OpenAI error code, message) of haproxy's own answers
    (502, "bad_gateway", "the controller failed to answer; the request may be retried"),
    (503, "unavailable", "no controller is available; retry later"),
    (504, "gateway_timeout", "the controller did not answer in time"),
]


def _error(status: int, code: str, message: str) -> str:
    error = {"message": message, "type": "server_error", "param": None, "code": code}
    body = json.dumps({"error": error}, separators=(",", ":"))
    retry = " hdr Retry-After 1" if status == 503 else ""
    return f"    http-error status {status} content-type application/json{retry} string '{body}'"


def _frontend(o: BalancerOptions) -> list[str]:
    check = f"check inter {o.check_interval_ms}ms fall {o.check_fall} rise {o.check_rise}"
    # A connection refused or timed out in live traffic marks the controller DOWN at once
    # (a killed or exited one), without waiting for `fall` failed checks; a good check brings
    # it back.
    check += " observe layer4 error-limit 1 on-error mark-down"
    return [
        "frontend tandem",
        f"    bind {o.bind}",
        "    default_backend controllers",
        "",
        "backend controllers",
        # Streams are long and uneven: the controller with the fewest open ones gets the next.
        "    balance leastconn",
        # 200 while it serves; 503 while draining or with no executor of its own, so haproxy
        # sends it nothing then.
        "    option httpchk GET /health",
        "    http-check expect status 200",
        # Which controller answered: for logs, the tests, and a client's bug report.
        "    http-response set-header X-Tandem-Controller %[srv_name]",
        *(f"    server {b.name} {b.address} {check}" for b in o.backends),
        "",
    ]
