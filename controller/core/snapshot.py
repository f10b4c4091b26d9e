"""One executor as the rest of the controller sees it: an immutable snapshot.

An executor session builds one on demand from its handshake answer, its scheduler, its
step-cost model and its counters. Placement, the admin report and the scrape-time fleet
collector read snapshots and nothing else of a session, so each sees the same picture and none
of them can change it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ExecutorSnapshot:
    """The state of one executor session at one moment."""

    # --- identity
    address: str  # host:port, the executor's key in the fleet
    source: str  # how it was found: static, dns or file
    kind: str | None  # device kind (gpu, tpu, cpu); None before the first handshake
    device: str | None  # device name; None before the first handshake
    incarnation: str | None  # the executor process's id; None before the first handshake
    incarnations: int  # distinct incarnation ids seen (process restarts + 1)
    # --- state and health
    state: str  # the session's state: connecting, healthy, unhealthy, draining or removed
    healthy: bool  # connected and taking new work
    state_since: float  # monotonic time the state last changed
    connected: bool  # a scheduler is live: set by a handshake, dropped when the executor is lost
    # --- step limits
    max_num_seqs: int  # most requests in one step (0 while not connected)
    max_num_batched_tokens: int  # most tokens in one step (the latest handshake's)
    # --- load
    requests: int  # requests placed there and not finished
    running: int  # requests its scheduler has admitted
    waiting: int  # requests queued in its scheduler (preempted ones included)
    uncomputed_tokens: int  # tokens of its requests not computed yet (queued prefill)
    decode_tokens: int  # output tokens its requests are still expected to generate (each
    # capped at the expected output length the snapshot was taken with)
    # --- KV cache
    num_blocks: int  # KV blocks on the device, the null block included
    block_size: int  # tokens per KV block (0 before the first handshake)
    used_blocks: int  # KV blocks held by requests
    kv_usage: float  # fraction of the KV blocks in use, 0..1
    # --- speed
    overhead: float  # measured (or prior) seconds of a near-empty step
    per_token: float  # measured (or prior) seconds per scheduled token
    tokens_per_second: float  # tokens computed per busy second, recent steps weighted most
    measured_steps: int  # steps the cost fit has seen (0: overhead and per_token are a prior)
    # --- counters
    steps: int  # steps run
    tokens: int  # tokens computed
    requests_placed: int  # requests placed there (moves included)
    prefix_cache_queries: int  # prompt tokens looked up in its prefix cache, every connection
    prefix_cache_hits: int  # prompt tokens found there, every connection
    losses: int  # times the executor was lost
    reconnects: int  # handshakes after a loss
    last_loss: str  # why it was last lost ("" if never)
    connect_error: str  # why connection attempts fail now ("" once connected)
    duplicate_of: str = ""  # the address of the session driving the same executor process,
    # while this one waits as its duplicate ("" otherwise)
    tensor_parallel_size: int = 1  # devices the executor shards the model over (its handshake's)
    owned: bool = False  # this controller owns the executor's session (a lease it renews)
    owner: str = ""  # the owner id holding it: this controller's own while owned, else the
    # other controller that refused the handshake ("" when unknown)
    assigned_to: str = ""  # the controller the division among live controllers gave it (its
    # advertised address; "" = this controller, or no peers configured)
    step_transport: str = ""  # how its open step stream goes: "socket" (its step socket),
    # "grpc" (ExecuteModel), "" (none open)

    @property
    def free_blocks(self) -> int:
        """KV blocks no request holds (the null block excluded)."""
        return self.num_blocks - 1 - self.used_blocks
