"""Least exposure, in-process: /health says healthy or not and nothing more; the admin routes
take admin keys only (never API keys), and without one answer direct loopback clients only;
an admin key serves no API route."""

from __future__ import annotations

import httpx
import pytest

from controller.api.admission import Admission, AdmissionLimits
from controller.api.auth import direct_loopback, is_admin_path
from tests.controller.api.test_request_ids import COMPLETION, FakeEngine, make_app, run

ADMIN_ROUTES = ("/admin/executors", "/admin/health")


def client_from(app, host: str) -> httpx.AsyncClient:
    """A client whose connection comes from `host`."""
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False, client=(host, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://test")


def statuses(app, host: str, path: str, headers_list: list[dict]) -> list[int]:
    async def main():
        async with client_from(app, host) as http:
            return [(await http.get(path, headers=h)).status_code for h in headers_list]

    return run(main())


def test_health_says_healthy_or_not_and_nothing_more():
    engine = FakeEngine()
    app = make_app(engine)

    async def main():
        async with client_from(app, "203.0.113.9") as http:
            ok = await http.get("/health")
            engine.healthy = False
            down = await http.get("/health")
            return ok, down

    ok, down = run(main())
    assert (ok.status_code, ok.json()) == (200, {"status": "ok"})
    assert (down.status_code, down.json()) == (503, {"status": "unavailable"})


def test_detailed_health_is_an_admin_route():
    app = make_app(FakeEngine())

    async def main():
        async with client_from(app, "127.0.0.1") as http:
            return (await http.get("/admin/health")).json()

    assert run(main()) == {"status": "ok", "healthy_executors": 0, "executors": []}


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1"])
def test_without_admin_keys_loopback_clients_reach_admin_routes(host):
    app = make_app(FakeEngine(api_keys=["sk-api"]))
    for path in ADMIN_ROUTES:
        assert statuses(app, host, path, [{}]) == [200]


@pytest.mark.parametrize("host", ["10.0.0.7", "192.0.2.1", "::ffff:10.0.0.7", "2001:db8::1"])
def test_without_admin_keys_other_clients_get_403(host):
    app = make_app(FakeEngine(api_keys=["sk-api"]))

    async def main():
        async with client_from(app, host) as http:
            return await http.get("/admin/executors", headers={"Authorization": "Bearer sk-api"})

    r = run(main())
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "admin_forbidden"
    assert r.json()["error"]["type"] == "permission_error"
    assert "x-request-id" in r.headers


@pytest.mark.parametrize(
    "header", ["X-Forwarded-For", "Forwarded", "X-Real-IP", "Via"], ids=str.lower
)
def test_a_proxied_loopback_request_is_not_local(header):
    """A proxy on the same host makes every client look local: its headers give it away."""
    app = make_app(FakeEngine())
    assert statuses(app, "127.0.0.1", "/admin/executors", [{header: "198.51.100.4"}]) == [403]


def test_admin_keys_open_admin_routes_only():
    app = make_app(FakeEngine(api_keys=["sk-api"], admin_api_keys=["sk-admin"]))
    wrong = [
        {},
        {"Authorization": "Bearer sk-api"},  # an API key never opens admin routes
        {"Authorization": "Bearer sk-admin-x"},
        {"Authorization": "Basic sk-admin"},
    ]
    admin = {"Authorization": "Bearer sk-admin"}
    for host in ("127.0.0.1", "10.0.0.7"):  # with keys configured, loopback needs one too
        for path in ADMIN_ROUTES:
            assert statuses(app, host, path, [*wrong, admin]) == [401] * 4 + [200]
    # An admin key serves no API route; the API key does.
    assert statuses(app, "10.0.0.7", "/v1/models", [admin]) == [401]
    assert statuses(app, "10.0.0.7", "/v1/models", [{"Authorization": "Bearer sk-api"}]) == [200]


def test_admin_keys_alone_leave_the_api_open():
    app = make_app(FakeEngine(admin_api_keys=["sk-admin"]))

    async def main():
        async with client_from(app, "10.0.0.7") as http:
            api = await http.post("/v1/completions", json=COMPLETION)
            admin = await http.get("/admin/executors")
            return api.status_code, admin.status_code, admin.headers.get("www-authenticate")

    assert run(main()) == (200, 401, "Bearer")


def test_path_and_peer_rules():
    assert is_admin_path("/admin/executors") and is_admin_path("/admin")
    assert not is_admin_path("/administrator") and not is_admin_path("/health")
    assert direct_loopback({"client": ("127.0.0.1", 1), "headers": []})
    assert not direct_loopback({"client": None, "headers": []})
    assert not direct_loopback({"client": ("localhost", 1), "headers": []})  # not an address
    assert not direct_loopback({"client": ("127.0.0.1", 1), "headers": [(b"via", b"1.1 p")]})


def test_the_peer_probe_needs_no_key_and_turns_503_when_draining():
    """/peer answers other controllers, which hold no key, whatever keys and exempt paths say;
    it shows no executor address; a draining controller answers 503 (its peers take over)."""
    engine = FakeEngine(api_keys=["sk-api"], admin_api_keys=["sk-admin"])
    engine.config.auth_exempt_paths = []
    admission = Admission(AdmissionLimits(0, 0, 1))
    app = make_app(engine, admission)

    async def main():
        async with client_from(app, "203.0.113.9") as http:
            live = await http.get("/peer")
            admission.start_draining()
            draining = await http.get("/peer")
            return live, draining

    live, draining = run(main())
    assert live.status_code == 200 and live.json()["owner"] == "host/fake"
    assert draining.status_code == 503
    assert statuses(app, "203.0.113.9", "/health", [{}]) == [401]  # not exempt here
