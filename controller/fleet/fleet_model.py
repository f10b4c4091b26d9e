"""What the fleet as a whole serves: one model, the tightest limits, every end-of-sequence id.

Executors join and leave; the API needs one answer for the context length, the KV room a
request may take and the tokens that end a sequence. `FleetModel` keeps the first executor's
model as the fleet's reference (a later executor serving another model is refused) and the
least of the connected executors' limits.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from common.wire.config import DeviceInfo


class ConnectedExecutor(Protocol):
    """What `FleetModel.refresh` reads of a connected session."""

    info: DeviceInfo | None  # its handshake's answer (None until then)
    num_blocks: int  # KV blocks in its pool, block 0 included
    block_size: int  # tokens per KV block


class FleetModel:
    """The fleet's model and limits, the least over its connected executors."""

    def __init__(self, max_model_len: int, eos_token_ids: Iterable[int]):
        self.max_model_len = max_model_len  # the fleet's context length (config until known)
        self.num_kv_tokens = 0  # the smallest executor KV capacity in tokens
        self.eos_token_ids: list[int] = list(eos_token_ids)  # tokenizer's + every executor's
        self._reference: DeviceInfo | None = None  # the first executor's model

    def check_compatible(self, address: str, info: DeviceInfo) -> None:
        """Refuse an executor that serves a different model than the fleet."""
        ref = self._reference
        if ref is None:
            self._reference = info
            return
        mine = (info.model.architecture, info.model.vocab_size, info.model.num_layers)
        theirs = (ref.model.architecture, ref.model.vocab_size, ref.model.num_layers)
        if mine != theirs:
            raise RuntimeError(
                f"executor {address} serves a different model {mine}; the fleet serves {theirs}"
            )

    def refresh(self, connected: list[ConnectedExecutor]) -> None:
        """Adopt the connected executors' limits (kept as they were while none is)."""
        known = [s for s in connected if s.info is not None]
        if not known:
            return
        self.max_model_len = min(s.info.model.max_model_len for s in known)
        self.num_kv_tokens = min((s.num_blocks - 1) * s.block_size for s in known)
        for s in known:
            for eos in s.info.model.eos_token_ids:
                if eos not in self.eos_token_ids:
                    self.eos_token_ids.append(eos)
