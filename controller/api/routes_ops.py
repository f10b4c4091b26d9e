"""Operations routes: health, the fleet's state, Prometheus metrics, version.

`/health` is for probes and load balancers, unauthenticated: its status code and
`{"status": ...}`, nothing about the fleet. The fleet's details (executor addresses, load,
admission) are under `/admin/`, behind the admin gate (`controller/api/auth.py` `AdminAuth`).
`/peer` is for the other controllers' probes, unauthenticated: this controller's advertised
address, owner id, the number of executors it drives and its load (responses in flight), no
executor address.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from controller.api.admission import Admission
from controller.fleet.engine import Engine
from controller.fleet.peers import PEER_PATH

VERSION = "0.1.0"
# What /admin/health shows per executor (/admin/executors shows everything).
_HEALTH_FIELDS = (
    "address",
    "state",
    "healthy",
    "kind",
    "incarnation",
    "running",
    "waiting",
    "kv_usage",
    "used_blocks",
)


def add_ops_routes(app: FastAPI, engine: Engine, admission: Admission) -> None:
    """/health, /peer, /admin/health, /admin/executors, /metrics and /version."""

    def status() -> tuple[str, int]:
        ok = engine.healthy and not admission.draining
        text = "draining" if admission.draining else "ok" if ok else "unavailable"
        return text, 200 if ok else 503

    @app.get("/health")
    async def health():
        text, code = status()
        return JSONResponse({"status": text}, status_code=code)

    @app.get(PEER_PATH)
    async def peer():
        # For the other controllers' probes (controller/fleet/peers.py): 200 while this
        # controller serves, 503 while it drains (its peers then take its executors).
        # Its load (responses in flight) bounds what prefix affinity sends it (forwarding.py).
        code = 503 if admission.draining else 200
        return JSONResponse({**engine.peer_state(), "load": admission.active}, status_code=code)

    @app.get("/admin/health")
    async def health_details():
        text, code = status()
        states = engine.executors_state()
        state = {
            "status": text,
            "healthy_executors": sum(e["healthy"] for e in states),
            "executors": [{k: e[k] for k in _HEALTH_FIELDS} for e in states],
        }
        return JSONResponse(state, status_code=code)

    @app.get("/admin/executors")
    async def executors():
        return {
            "executors": engine.executors_state(),
            "requests_waiting_for_executor": len(engine.waiting),
            "summary": engine.fleet_summary(),
            "admission": {
                "active_responses": admission.active,
                "queued_requests": admission.queued_requests,
                "queued_tokens": admission.queued_tokens,
                "rejected": admission.rejected,
                "draining": admission.draining,
            },
        }

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": VERSION}
