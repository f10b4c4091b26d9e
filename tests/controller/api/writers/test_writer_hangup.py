"""A writer watches its clients' sockets for readability: a client that closes the connection,
or only its sending side, while its stream waits for tokens is noticed at once (DONE
"client_gone", no write needed), and bytes a client sends (a pipelined request) are left for
the core to read after the stream."""

from __future__ import annotations

import socket
import time

import pytest

from controller.api.writers import frame as fr
from controller.api.writers.meta import StreamMeta
from controller.text.tokenizer import Tokenizer
from tests.controller.api.writers.test_writer import META, MODEL_DIR, _read_all, _threaded_writer

GONE = fr.DONE_REASONS.index("client_gone")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_model_dir(MODEL_DIR)


def _meta(seq: int) -> StreamMeta:
    return StreamMeta(META.id, "text_completion", META.created, META.model, "completion", [seq])


def _open_kept(core, slot: int, meta: StreamMeta) -> tuple[socket.socket, socket.socket]:
    """A stream whose connection the core keeps (its end, as uvicorn's), and the client."""
    ours, client = socket.socketpair()
    socket.send_fds(core.control, [fr.encode_open(slot, meta.to_json())], [ours.fileno()])
    return ours, client


@pytest.mark.parametrize("how", ["half", "close", "reset"])
def test_a_client_that_hangs_up_is_noticed_without_a_write(tok, how):
    core, thread = _threaded_writer(tok)
    ours, client = _open_kept(core, 1, _meta(10))
    start = time.monotonic()
    if how == "half":
        client.shutdown(socket.SHUT_WR)  # still reading, but done sending: gone, as uvicorn sees it
    elif how == "close":
        client.close()
    else:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
        client.close()
    assert core.replies(1) == [(fr.DONE, 1, GONE)]
    assert time.monotonic() - start < 5  # no step came: only the hangup could end it
    ours.close()
    if how == "half":
        client.close()
    core.control.close()
    thread.join(10)
    assert not thread.is_alive()


def test_a_pipelined_request_is_left_for_the_core(tok):
    core, thread = _threaded_writer(tok)
    ours, client = _open_kept(core, 1, _meta(11))
    client.sendall(b"POST /v1/completions HTTP/1.1\r\n")  # the next request, early
    time.sleep(0.2)  # the writer sees it (and leaves it)
    ids = tok.backend.encode(" hello there").ids
    builder = fr.StepBuilder()
    builder.add(11, ids[:1])
    core.step(builder)
    builder.add(11, ids[1:], "length")
    core.step(builder)
    assert core.replies(1) == [(fr.DONE, 1, 0)]  # finished, not "client_gone"
    ours.settimeout(5)
    assert ours.recv(100) == b"POST /v1/completions HTTP/1.1\r\n"
    ours.close()
    body = _read_all(client)
    assert body.endswith(b"data: [DONE]\n\n\r\n") and b'" there"' in body
    core.control.close()
    thread.join(10)
