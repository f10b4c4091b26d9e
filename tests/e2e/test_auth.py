"""API keys: every route but the exempt ones needs a valid Bearer key (401 in OpenAI's shape
otherwise); keys come from flags, a key file and $TANDEM_API_KEY. The admin routes take the
admin key instead, never an API key, and the admin key opens no API route."""

from __future__ import annotations

import httpx
import openai
import pytest

from controller.api.auth import ALWAYS_EXEMPT_PATHS, KeyChecker, bearer_token
from controller.settings import load_api_keys
from tests.support.processes import start_server

KEYS = {"flag": "sk-flag-0123", "file": "sk-file-4567", "env": "sk-env-89ab"}
ADMIN_KEY = "sk-admin-cdef"
# Exempt by default (--auth-exempt-path), and /peer always: other controllers probe it
# (controller.api.auth.ALWAYS_EXEMPT_PATHS; it reveals no executor address).
EXEMPT = {"/health", "/metrics", *ALWAYS_EXEMPT_PATHS}


def test_key_sources(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# comment\n\n  a-key  \nb-key\n")
    keys = load_api_keys(["c-key", " "], [str(path)], environ={"TANDEM_API_KEY": "d-key"})
    assert keys == ["c-key", "a-key", "b-key", "d-key"]
    assert load_api_keys([], [], environ={}) == []


def test_checker_and_header_parsing():
    checker = KeyChecker(["one", "two"])
    assert checker.valid("one") and checker.valid("two")
    assert not checker.valid("on") and not checker.valid("") and not checker.valid("one ")
    assert not KeyChecker([])
    assert bearer_token([(b"authorization", b"Bearer abc")]) == "abc"
    assert bearer_token([(b"authorization", b"bearer   abc ")]) == "abc"
    assert bearer_token([(b"authorization", b"Basic abc")]) is None
    assert bearer_token([(b"authorization", b"Bearer")]) is None
    assert bearer_token([]) is None


@pytest.fixture(scope="module")
def keyed(default_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    key_file = tmp / "keys.txt"
    key_file.write_text(f"# API keys\n{KEYS['file']}\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_API_KEY", KEYS["env"])  # read by the spawned controller
        s = start_server(
            default_model_dir,
            str(tmp),
            controller_args=[
                "--api-key",
                KEYS["flag"],
                "--api-key-file",
                str(key_file),
                "--admin-api-key",
                ADMIN_KEY,
            ],
        )
    yield s
    s.stop()


def _routes(model_dir: str) -> list[tuple[str, str]]:
    """(method, path) of every route of the app, built in-process from the same flags."""
    from controller.api.server import create_app
    from controller.api.serving import OpenAIServing
    from controller.fleet.engine import Engine
    from controller.main import load_config
    from controller.text.tokenizer import Tokenizer

    config = load_config(["--model", model_dir, "--api-key", "x"])
    tokenizer = Tokenizer.from_model_dir(model_dir)
    engine = Engine(config, tokenizer)
    app = create_app(engine, OpenAIServing(engine, tokenizer, "m", 20), start_engine=False)
    out = []
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                out.append((method, route.path))
    return out


def test_every_route_needs_a_key(keyed, default_model_dir):
    routes = _routes(default_model_dir)
    paths = {p for _, p in routes}
    assert {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/tokenize",
        "/admin/executors",
        "/openapi.json",
    } <= paths
    with httpx.Client(base_url=keyed.base_url, timeout=60) as http:
        for method, path in routes:
            kw = {"json": {}} if method == "POST" else {}
            for headers in (
                {},
                {"Authorization": "Bearer wrong"},
                {"Authorization": f"Basic {KEYS['flag']}"},
                {"Authorization": f"Bearer {KEYS['flag']}x"},
                {"Authorization": f"Bearer {ADMIN_KEY}x"},
            ):
                r = http.request(method, path, headers=headers, **kw)
                if path in EXEMPT:
                    assert r.status_code != 401, (method, path, headers)
                    continue
                assert r.status_code == 401, (method, path, headers, r.status_code)
                assert r.headers["www-authenticate"] == "Bearer"
                assert r.json() == {
                    "error": {
                        "message": r.json()["error"]["message"],
                        "type": "invalid_request_error",
                        "param": None,
                        "code": "invalid_api_key",
                    }
                }
            admin = path.startswith("/admin/")
            for key in KEYS.values():
                r = http.request(method, path, headers={"Authorization": f"Bearer {key}"}, **kw)
                if admin:  # an API key never opens an admin route
                    assert r.status_code == 401, (method, path, r.text)
                    continue
                assert r.status_code != 401, (method, path, r.text)
                assert r.status_code < 500, (method, path, r.text)
            r = http.request(method, path, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, **kw)
            if path in EXEMPT:
                continue
            if admin:
                assert r.status_code == 200, (method, path, r.text)
            else:  # the admin key serves no API route
                assert r.status_code == 401, (method, path, r.text)


def test_openai_client(keyed):
    wrong = openai.OpenAI(base_url=keyed.base_url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        wrong.models.list()
    assert exc.value.status_code == 401 and exc.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=keyed.model_name, prompt="Hi", max_tokens=2)
    for key in KEYS.values():
        client = openai.OpenAI(
            base_url=keyed.base_url + "/v1", api_key=key, max_retries=0, timeout=120
        )
        assert [m.id for m in client.models.list().data] == [keyed.model_name]
        r = client.chat.completions.create(
            model=keyed.model_name,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            temperature=0,
        )
        assert r.choices[0].message.content is not None
        stream = client.completions.create(
            model=keyed.model_name, prompt="Hello", max_tokens=3, temperature=0, stream=True
        )
        assert sum(1 for _ in stream) >= 1


def test_exempt_paths_answer_without_key(keyed):
    health = httpx.get(keyed.base_url + "/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok"}  # nothing more
    assert "vllm:num_requests_running" in httpx.get(keyed.base_url + "/metrics", timeout=10).text
