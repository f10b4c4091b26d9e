"""Tool calls in chat responses through the real app in-process (the default model's tokenizer,
a fake engine that writes a given output token by token): message.tool_calls, streamed
delta.tool_calls in OpenAI's incremental form assembling to the same calls, finish reasons,
parallel_tool_calls false, n > 1, and tool_choice none / auto left as text."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from controller.api.server import create_app
from controller.api.serving import OpenAIServing
from controller.core.outputs import OutputDelta
from controller.text.tokenizer import Tokenizer
from tests.support.fake_engine import FakeEngineBase

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "noop"}},
]
TWO_CALLS = (
    'Checking.<tool_call>[{"name": "get_weather", "arguments": {"city":"Paris"}}, '
    '{"name": "noop", "arguments": {}}]</tool_call>'
)


class ScriptedEngine(FakeEngineBase):
    """Writes `output` for every sequence, one token per delta, ending with `finish_reason`."""

    def __init__(self, tokenizer: Tokenizer, output: str, finish_reason: str = "stop"):
        super().__init__(tokenizer.eos_token_ids)
        self.tokenizer, self.output, self.finish_reason = tokenizer, output, finish_reason

    async def generate(self, gen):
        self.gens.append(gen)
        ids = self.tokenizer.encode(self.output, add_special_tokens=False)
        for k, token in enumerate(ids):
            last = k == len(ids) - 1
            yield OutputDelta(
                gen.request_id,
                text=self.tokenizer.decode([token]),
                token_ids=[token],
                finished=last,
                finish_reason=self.finish_reason if last else None,
                num_prompt_tokens=len(gen.prompt_token_ids),
                num_output_tokens=k + 1,
            )


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer.from_model_dir(default_model_dir)


def _post(tokenizer, output: str, body: dict, finish_reason: str = "stop", engine=None):
    engine = engine or ScriptedEngine(tokenizer, output, finish_reason)
    app = create_app(engine, OpenAIServing(engine, tokenizer, "m", 5), start_engine=False)
    full = {"model": "m", "messages": [{"role": "user", "content": "weather?"}], **body}

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            return await c.post("/v1/chat/completions", json=full)

    r = asyncio.run(main())
    assert r.status_code == 200, r.text
    return r


def _streamed(tokenizer, output: str, body: dict, finish_reason: str = "stop") -> list[dict]:
    """The streamed chunks' choices, assembled per index into messages (as a client does)."""
    r = _post(tokenizer, output, {**body, "stream": True}, finish_reason)
    lines = [x[6:] for x in r.text.split("\n") if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    out: dict[int, dict] = {}
    for line in lines[:-1]:
        for choice in json.loads(line)["choices"]:
            msg = out.setdefault(choice["index"], {"content": "", "calls": {}, "finish": None})
            delta = choice["delta"]
            msg["content"] += delta.get("content") or ""
            for tc in delta.get("tool_calls", []):
                call = msg["calls"].setdefault(tc["index"], {"name": None, "arguments": ""})
                if "id" in tc:  # the first chunk of a call: all but its arguments
                    assert tc["id"].startswith("call_") and tc["type"] == "function"
                    assert tc["function"]["arguments"] == "" and call["name"] is None
                    call["name"] = tc["function"]["name"]
                else:
                    assert call["name"] is not None
                call["arguments"] += tc["function"].get("arguments", "")
            msg["finish"] = choice["finish_reason"] or msg["finish"]
    return [out[i] for i in sorted(out)]


def _whole(tokenizer, output: str, body: dict, finish_reason: str = "stop") -> list[dict]:
    choices = _post(tokenizer, output, body, finish_reason).json()["choices"]
    out = []
    for c in choices:
        calls = c["message"].get("tool_calls", [])
        assert len({tc["id"] for tc in calls}) == len(calls)
        out.append(
            {
                "content": c["message"]["content"],
                "calls": {
                    k: {"name": tc["function"]["name"], "arguments": tc["function"]["arguments"]}
                    for k, tc in enumerate(calls)
                },
                "finish": c["finish_reason"],
            }
        )
    return out


def _same(whole: list[dict], streamed: list[dict]) -> None:
    for w, s in zip(whole, streamed, strict=True):
        assert (w["content"] or "") == s["content"]
        assert w["calls"] == s["calls"] and w["finish"] == s["finish"]


def test_calls_whole_and_streamed(tokenizer):
    body = {"tools": TOOLS, "tool_choice": "auto", "n": 2}
    whole = _whole(tokenizer, TWO_CALLS, body)
    assert len(whole) == 2
    for choice in whole:
        assert choice["content"] == "Checking."
        assert choice["calls"] == {
            0: {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            1: {"name": "noop", "arguments": "{}"},
        }
        assert choice["finish"] == "tool_calls"
    _same(whole, _streamed(tokenizer, TWO_CALLS, body))


def test_only_calls_have_no_content(tokenizer):
    output = TWO_CALLS.removeprefix("Checking.")
    r = _post(tokenizer, output, {"tools": TOOLS, "tool_choice": "required"})
    message = r.json()["choices"][0]["message"]
    assert message["content"] is None and len(message["tool_calls"]) == 2
    body = {"tools": TOOLS, "tool_choice": "required"}
    _same(_whole(tokenizer, output, body), _streamed(tokenizer, output, body))


def test_parallel_tool_calls_false_keeps_one_call(tokenizer):
    body = {"tools": TOOLS, "parallel_tool_calls": False}
    whole = _whole(tokenizer, TWO_CALLS, body)
    assert list(whole[0]["calls"]) == [0]
    _same(whole, _streamed(tokenizer, TWO_CALLS, body))


def test_an_output_cut_by_length_is_not_tool_calls(tokenizer):
    body = {"tools": TOOLS, "tool_choice": "required"}
    cut = TWO_CALLS[: len(TWO_CALLS) // 2]
    whole = _whole(tokenizer, cut, body, "length")
    assert whole[0]["calls"] == {} and whole[0]["finish"] == "length"
    assert whole[0]["content"] == cut
    _same(whole, _streamed(tokenizer, cut, body, "length"))


@pytest.mark.parametrize("choice", ["none", None])
def test_no_tools_or_none_leave_the_output_as_text(tokenizer, choice):
    body = {} if choice is None else {"tools": TOOLS, "tool_choice": choice}
    whole = _whole(tokenizer, TWO_CALLS, body)
    assert whole[0] == {"content": TWO_CALLS, "calls": {}, "finish": "stop"}
    _same(whole, _streamed(tokenizer, TWO_CALLS, body))


def test_auto_without_calls_is_text(tokenizer):
    whole = _whole(tokenizer, "It is sunny.", {"tools": TOOLS})
    assert whole[0] == {"content": "It is sunny.", "calls": {}, "finish": "stop"}


def test_tool_choice_none_hides_the_tools_from_the_model(tokenizer):
    engine = ScriptedEngine(tokenizer, "ok")
    serving = OpenAIServing(engine, tokenizer, "m", 5)
    messages = [{"role": "user", "content": "weather?"}]
    shown = serving.render_chat(messages, True, TOOLS)
    assert "<tools>" in shown and "get_weather" in shown
    assert "<tools>" not in serving.render_chat(messages, True, None)
    _post(tokenizer, "ok", {"tools": TOOLS, "tool_choice": "none"}, engine=engine)
    _post(tokenizer, "ok", {"tools": TOOLS, "tool_choice": "auto"}, engine=engine)
    hidden, seen = (tokenizer.decode(g.prompt_token_ids, False) for g in engine.gens)
    assert "<tools>" not in hidden and "<tools>" in seen
