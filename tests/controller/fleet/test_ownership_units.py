"""The controller's side of executor ownership, without processes: reading a refusal, the
pace of retries while another controller owns an executor, owner ids."""

from __future__ import annotations

import grpc
from grpc.aio import AioRpcError, Metadata

from common.wire.ownership import OWNER_TRAILER, SECONDS_LEFT_TRAILER
from controller.fleet.ownership import new_owner_id, refusal, retry_delay
from controller.settings import ControllerConfig


def _error(code: grpc.StatusCode, trailers: tuple = ()) -> AioRpcError:
    return AioRpcError(code, Metadata(), Metadata(*trailers), "details")


def test_a_refusal_names_the_owner_and_its_lease():
    error = _error(
        grpc.StatusCode.FAILED_PRECONDITION,
        ((OWNER_TRAILER, "host/abc"), (SECONDS_LEFT_TRAILER, "4.250")),
    )
    assert refusal(error) == ("host/abc", 4.25)
    assert refusal(_error(grpc.StatusCode.FAILED_PRECONDITION)) is None  # another precondition
    assert refusal(_error(grpc.StatusCode.UNAVAILABLE, ((OWNER_TRAILER, "x"),))) is None


def test_retries_come_when_the_lease_would_expire_and_at_least_every_renewal_period():
    cfg = ControllerConfig(model="m", executor_lease_seconds=9.0, reconnect_backoff_max=10.0)
    assert retry_delay(1.0, cfg) == 1.1  # just after the other owner's lease would expire
    assert retry_delay(8.0, cfg) == 3.0  # but every third of our lease (a release is seen)
    assert retry_delay(0.0, cfg) == cfg.reconnect_backoff_min
    fast = ControllerConfig(model="m", executor_lease_seconds=9.0, reconnect_backoff_max=1.0)
    assert retry_delay(8.0, fast) == 1.0


def test_owner_ids_are_new_per_process_and_name_the_host():
    first, second = new_owner_id(), new_owner_id()
    assert first != second
    assert first.split("/")[0] == second.split("/")[0] != ""
