"""A step larger than one message (split by the core's channel into several STEPs) reaches
the client whole: the writer writes every token of it, its end last."""

from __future__ import annotations

import socket

import pytest

from controller.api.writers import frame as fr
from controller.api.writers.meta import StreamMeta
from controller.api.writers.pool import SNDBUF, message_limit
from controller.api.writers.worker import MAX_MESSAGE
from controller.text.tokenizer import Tokenizer
from tests.controller.api.writers.test_writer import META, MODEL_DIR, _read_all, _threaded_writer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_model_dir(MODEL_DIR)


def test_a_step_over_the_message_limit_reaches_the_client_whole(tok):
    core, thread = _threaded_writer(tok)
    core.control.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
    limit = message_limit(core.control)
    assert 0 < limit <= MAX_MESSAGE
    word = tok.backend.encode(" word").ids
    metas = [StreamMeta(META.id, "text_completion", 0, "m", "completion", [s]) for s in (1, 2)]
    clients = [core.open(slot, meta) for slot, meta in zip((1, 2), metas)]
    builder = fr.StepBuilder()
    count = limit // 4 // len(word) + 10  # the first sequence alone is over the limit
    builder.add(1, word * count, "length")
    builder.add(2, word * 3, "length")
    messages = builder.take_all(limit)
    assert len(messages) >= 2 and all(len(m) <= limit for m in messages)
    for message in messages:
        core.control.send(message)
    bodies = [_read_all(c) for c in clients]
    assert sorted(core.replies(2)) == [(fr.DONE, 1, 0), (fr.DONE, 2, 0)]
    for body, n in zip(bodies, (count, 3)):
        assert body.count(b" word") == n
        assert body.count(b'"finish_reason": "length"') == 1
        assert body.endswith(b"data: [DONE]\n\n\r\n")
    core.control.close()
    thread.join(10)
