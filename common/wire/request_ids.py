"""Sequence ids: how the controller names the sequences of one API request on the wire.

An API request has an id R (the client's X-Request-Id, or one the controller generated). Each
of its prompts and choices becomes a sequence ``U-<prompt index>-<choice index>``, the id the
scheduler, the fleet and the executor know it by, where U is R when the controller generated
it and ``R~<k>`` when a client sent it (k a serial of the controller process; ``~`` never
occurs in R): clients may repeat an id, sequence ids are never reused.

Every log line that prints a sequence id thus contains R, and ``request_id_of`` recovers R from
a sequence id, for the ``request_id`` of log records written away from the request's task
(executors, the fleet's step loops).
"""

from __future__ import annotations

SERIAL_MARK = "~"  # separates a client's request id from the serial that makes it unique


def sequence_id(request_id: str, prompt_index: int, choice_index: int) -> str:
    """The id of one sequence of request ``request_id``."""
    return f"{request_id}-{prompt_index}-{choice_index}"


def request_id_of(seq_id: str) -> str:
    """The request id a sequence id derives from; an id of another shape is returned whole."""
    parts = seq_id.rsplit("-", 2)
    if len(parts) != 3 or not parts[0] or not all(_is_index(p) for p in parts[1:]):
        return seq_id
    base, mark, serial = parts[0].rpartition(SERIAL_MARK)
    return base if mark and base and _is_index(serial) else parts[0]


def _is_index(text: str) -> bool:
    return text.isascii() and text.isdigit()
