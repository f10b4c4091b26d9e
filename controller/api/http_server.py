"""The controller's HTTP server settings: uvicorn's configuration with the connection guard
(`controller/api/http_guard.py`), the file-descriptor room the connection cap needs, and the
connection metrics."""

from __future__ import annotations

import logging
import resource
from typing import Any

import uvicorn
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from controller.api.http_guard import CLOSE_REASONS, HTTPLimits, HTTPStats, guarded_protocol
from controller.api.shutdown import CLOSE_SECONDS

log = logging.getLogger(__name__)

# File descriptors kept for everything but client connections: the listening socket, gRPC
# channels to executors (one or two each), DNS lookups, model and key files, logs.
FD_RESERVE = 512


def fit_connection_limit(limit: int, reserve: int = FD_RESERVE) -> int:
    """Raise the open-file limit to its hard limit, and hold `limit` connections below it with
    `reserve` descriptors to spare: accepting until descriptors run out would leave none for
    reconnecting to an executor. 0 (no bound) stays 0."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    except (ValueError, OSError):  # not allowed here: keep what there is
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if limit == 0 or soft == resource.RLIM_INFINITY:
        return limit
    room = max(soft - reserve, 1)
    if limit > room:
        log.warning(
            "--http-max-connections %d lowered to %d: the open-file limit is %d", limit, room, soft
        )
        return room
    return limit


def uvicorn_config(app, config: Any, stats: HTTPStats) -> uvicorn.Config:
    """uvicorn's configuration for the controller's settings, its HTTP/1.1 protocol guarded
    by the connection cap, the head timer and the head size bound."""
    limits = HTTPLimits(
        max_connections=fit_connection_limit(config.http_max_connections),
        max_header_bytes=config.http_max_header_bytes,
        header_timeout=config.http_header_timeout,
    )
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        http=guarded_protocol(limits, stats),
        log_level="warning",
        timeout_graceful_shutdown=CLOSE_SECONDS,
        timeout_keep_alive=config.http_keep_alive,
        ssl_certfile=config.ssl_certfile or None,
        ssl_keyfile=config.ssl_keyfile or None,
    )


class HTTPCollector:
    """Scrape-time metrics of the HTTP connections: open now, and closed early by reason."""

    def __init__(self, stats: HTTPStats):
        self.stats = stats  # the guard's counters

    def collect(self):
        yield GaugeMetricFamily(
            "tandem:http_connections", "Open HTTP connections", value=self.stats.open
        )
        closed = CounterMetricFamily(
            "tandem:http_connections_closed",
            "HTTP connections the server closed early, by reason",
            labels=["reason"],
        )
        for reason in CLOSE_REASONS:
            closed.add_metric([reason], self.stats.closed[reason])
        yield closed
