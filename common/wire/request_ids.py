"""Sequence ids: how the controller names the sequences of one API request on the wire.

An API request has an id R (the client's X-Request-Id, or one the controller generated). Each
of its prompts and choices becomes a sequence ``R-<prompt index>-<choice index>``, the id the
scheduler, the fleet and the executor know it by. When two responses in flight share R (two
clients sent the same X-Request-Id), the later one's sequences are named after ``R~<k>``
instead; ``~`` never occurs in R, so sequence ids stay unique.

Every log line that prints a sequence id thus contains R, and ``request_id_of`` recovers R from
a sequence id, for the ``request_id`` of log records written away from the request's task
(executors, the fleet's step loops).
"""

from __future__ import annotations

CLASH_MARK = "~"  # separates R from the serial that makes a clashing request's ids unique


def sequence_id(request_id: str, prompt_index: int, choice_index: int) -> str:
    """The id of one sequence of request ``request_id``."""
    return f"{request_id}-{prompt_index}-{choice_index}"


def request_id_of(seq_id: str) -> str:
    """The request id a sequence id derives from; an id of another shape is returned whole."""
    parts = seq_id.rsplit("-", 2)
    if len(parts) != 3 or not parts[0] or not all(_is_index(p) for p in parts[1:]):
        return seq_id
    base, mark, serial = parts[0].rpartition(CLASH_MARK)
    return base if mark and base and _is_index(serial) else parts[0]


def _is_index(text: str) -> bool:
    return text.isascii() and text.isdigit()
