"""What the engine fails alone, before or between executors: a request whose data cannot go
on the wire (before it is placed anywhere), and a request moved off lost executors more than
`max_request_moves` times (it may be what takes them down). Both end with an error delta to
their client; nothing else is touched."""

from __future__ import annotations

import asyncio

import pytest

from common.wire.step_types import SamplingParams
from controller.core.outputs import GenerationRequest
from controller.fleet.engine import Engine
from controller.fleet.maintenance import FAILOVER_SETTLE
from controller.fleet.tracked import track
from controller.settings import ControllerConfig
from controller.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer.from_model_dir(default_model_dir)


def _engine(tokenizer: Tokenizer, model_dir: str, **settings) -> Engine:
    config = ControllerConfig(model=model_dir, executors=["127.0.0.1:1"], **settings)
    return Engine(config, tokenizer)


def _gen(rid: str, **sampling) -> GenerationRequest:
    return GenerationRequest(rid, [1, 2, 3], SamplingParams(**sampling), max_tokens=4)


def test_a_request_that_cannot_go_on_the_wire_fails_before_placement(tokenizer, default_model_dir):
    async def main() -> None:
        engine = _engine(tokenizer, default_model_dir)
        deltas = [d async for d in engine.generate(_gen("r-0-1", seed=2**63))]
        assert len(deltas) == 1 and deltas[0].finished and deltas[0].finish_reason == "error"
        assert "cannot be sent to an executor" in deltas[0].error
        assert engine.waiting == {}  # never placed, never waiting

    asyncio.run(main())


def test_a_request_moved_past_the_bound_fails_and_the_others_move(tokenizer, default_model_dir):
    async def main() -> None:
        engine = _engine(tokenizer, default_model_dir, max_request_moves=2)
        tired, fresh = track(_gen("tired-0-0"), tokenizer), track(_gen("fresh-0-0"), tokenizer)
        tired.num_failovers = 2  # moved twice already
        engine.relocate([tired, fresh], "127.0.0.1:9")
        last = tired.queue.get_nowait()
        assert last.finish_reason == "error" and "lost 3 times" in last.error
        assert "not moved more than 2 times" in last.error
        assert fresh.queue.empty() and fresh.num_failovers == 1
        assert list(engine.waiting) == ["fresh-0-0"]  # no executor here: it waits for one
        assert (
            engine.metrics.request_success.labels(
                engine.config.served_model_name, "none", "none", "error"
            )._value.get()
            == 1
        )

    asyncio.run(main())


def test_a_moved_request_settles_before_it_is_placed(tokenizer, default_model_dir):
    """Executors that die together are found lost one by one: a moved request waits
    FAILOVER_SETTLE before placement, so it does not land on a sibling not yet seen lost."""

    async def main() -> None:
        engine = _engine(tokenizer, default_model_dir)
        placed: list[str] = []

        def place(tracked, exclude=None, startable_only=False) -> bool:
            placed.append(tracked.gen.request_id)
            return True

        engine._place_or_fail = place
        moved = track(_gen("moved-0-0"), tokenizer)
        engine.relocate([moved], "127.0.0.1:9")
        engine._place_waiting()
        assert placed == [] and list(engine.waiting) == ["moved-0-0"]  # settling
        await asyncio.sleep(FAILOVER_SETTLE + 0.05)
        assert engine._kick.is_set()  # the pass is woken when the settle ends
        engine._place_waiting()
        assert placed == ["moved-0-0"] and engine.waiting == {}

    asyncio.run(main())
