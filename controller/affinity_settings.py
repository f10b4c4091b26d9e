"""Prefix affinity across controllers: which controller serves a request whose prompt prefix
another one may have cached (controller/fleet/affinity.py, controller/api/forwarding.py). Part of
ControllerConfig (controller/settings.py), kept apart because it is one concern of its own."""

from __future__ import annotations

from common.settings import TandemSettings, setting

PEER_AFFINITY = "peer affinity: requests sharing a prompt prefix meet on one controller"


class AffinitySettings(TandemSettings):
    """How a controller with peers sends a request to the controller its prompt's leading
    tokens hash to (off, or without peers: every controller serves what it receives)."""

    peer_affinity: bool = setting(
        True,
        "forward a request to the controller its prompt's leading tokens hash to "
        "(rendezvous over the live peers), so that requests sharing a prefix meet on the "
        "executors that cache it; only with peers",
        group=PEER_AFFINITY,
    )
    peer_affinity_key_tokens: int = setting(
        256,
        "leading prompt tokens that choose the home controller (shorter prompts: their whole "
        "16-token blocks; under one block: served where received)",
        group=PEER_AFFINITY,
        ge=1,
    )
    peer_affinity_load_factor: float = setting(
        1.25,
        "a home controller with more than this times the mean load of the live controllers "
        "(requests in flight) is passed over for the next in the key's order",
        group=PEER_AFFINITY,
        ge=1.0,
    )
    peer_affinity_connect_timeout: float = setting(
        1.0,
        "seconds to connect to the home controller and send the request; past them, or on a "
        "503/429 before any byte, the request is served where it was received",
        group=PEER_AFFINITY,
        gt=0,
    )
