"""The processes of a tensor-parallel GPU executor and the channel between them.

One executor of ``--tensor-parallel-size N`` is N processes, one per device: rank 0 is the
executor the controller talks to (gRPC, the persistent batch, sampling); ranks 1..N-1 are
followers it starts (``RankGroup.start``) that hold their shards of the model and KV cache and
run every forward pass in lockstep with it.

Two torch.distributed groups join them: the compute group (NCCL on CUDA, gloo on the CPU) for
the model's all-reduces and the logits gather, and a gloo control group over which rank 0
broadcasts commands (``send``) and, for lifecycle commands, gathers the followers' replies
(``gather``). Every rank makes the same collective calls in the same order: rank 0 sends one
command, each follower receives it, then all run the command's collectives.

A rank that dies ends the executor: rank 0 watches its followers and exits with the device
failure status the moment one is gone (a collective would otherwise wait for it for ever, or
fail the step's requests instead of letting the controller move them); followers die with
rank 0 (the kernel's parent-death signal).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from common.host.settings import EXIT_DEVICE_FAILED, ExecutorConfig
from common.torch.parallel import TensorParallel

log = logging.getLogger(__name__)

#: How long a collective may wait for a rank before failing (a live rank answers in a step's
#: time; a dead one is noticed by the watchdog long before).
_COLLECTIVE_TIMEOUT = timedelta(minutes=30)
_WATCH_INTERVAL = 0.1  # seconds between checks that every follower lives


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: rank 0's TCP store."""

    host: str  # the store's address (the loopback: all ranks share the host)
    port: int  # the store's port
    size: int  # ranks in the group


@dataclass
class Command:
    """One message from rank 0 to the followers."""

    name: str  # what to do (see executor_gpu.follower)
    args: tuple = ()  # its arguments (host objects and CPU tensors)
    reply: bool = False  # whether rank 0 gathers the followers' replies


def compute_backend(device: torch.device) -> str:
    """The collective backend of the model's tensors on ``device``."""
    return "nccl" if device.type == "cuda" else "gloo"


def join(rendezvous: Rendezvous, rank: int, device: torch.device, store: Any = None):
    """Join the process group as ``rank``; returns (the model's TensorParallel, the control
    group)."""
    if store is None:
        store = dist.TCPStore(
            rendezvous.host,
            rendezvous.port,
            rendezvous.size,
            is_master=False,
            timeout=_COLLECTIVE_TIMEOUT,
        )
    dist.init_process_group(
        compute_backend(device),
        store=store,
        rank=rank,
        world_size=rendezvous.size,
        timeout=_COLLECTIVE_TIMEOUT,
        device_id=device if device.type == "cuda" else None,
    )
    control = dist.new_group(backend="gloo", timeout=_COLLECTIVE_TIMEOUT)
    return TensorParallel(rank, rendezvous.size, dist.group.WORLD), control


def die_with_parent() -> None:
    """Have the kernel kill this process when its parent (rank 0) dies (Linux), and also
    exit if the parent is already gone."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the watchdog thread below still works
        pass
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the rank-th CUDA device from the configured one; the CPU for
    every rank on the CPU."""
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + rank)
    return device


class RankGroup:
    """Rank 0's side: the followers' processes, the control channel, the watchdog."""

    def __init__(self, tp: TensorParallel, control: Any, processes: list[Any]):
        self.tp = tp  # rank 0's place in the group (what its model is built with)
        self.control = control  # the gloo group commands travel on
        self.processes = processes  # the followers, ranks 1..N-1
        self._closing = False
        self._watchdog = threading.Thread(target=self._watch, name="rank-watch", daemon=True)
        self._watchdog.start()

    @classmethod
    def start(
        cls,
        config: ExecutorConfig,
        device: torch.device,
        follower: Callable[[ExecutorConfig, int, Rendezvous], None],
    ) -> RankGroup:
        """Start ranks 1..N-1 (``follower(config, rank, rendezvous)`` in fresh processes) and
        join them as rank 0."""
        size = config.tensor_parallel_size
        store = dist.TCPStore(
            "127.0.0.1",
            0,
            size,
            is_master=True,
            timeout=_COLLECTIVE_TIMEOUT,
            wait_for_workers=False,
        )
        rendezvous = Rendezvous("127.0.0.1", store.port, size)
        context = multiprocessing.get_context("spawn")
        processes = []
        for rank in range(1, size):
            process = context.Process(
                target=follower,
                args=(config, rank, rendezvous),
                name=f"tandem-rank-{rank}",
                daemon=True,  # ended with rank 0's interpreter
            )
            process.start()
            processes.append(process)
        log.info(
            "tensor parallel: %d ranks on %s (followers: pids %s)",
            size,
            device,
            [p.pid for p in processes],
        )
        tp, control = join(rendezvous, 0, device, store)
        return cls(tp, control, processes)

    # --- commands -------------------------------------------------------------------------

    def send(self, name: str, *args: Any, reply: bool = False) -> None:
        """Broadcast a command to the followers."""
        self._collective(dist.broadcast_object_list, [Command(name, args, reply)], src=0)

    def gather(self) -> list[Any]:
        """The followers' replies to the last command sent with ``reply``; a follower's error
        is raised here."""
        replies: list[Any] = [None] * self.tp.size
        self._collective(dist.gather_object, None, replies, dst=0)
        for rank, value in enumerate(replies[1:], start=1):
            if isinstance(value, BaseException):
                raise RuntimeError(f"tensor-parallel rank {rank} failed: {value!r}") from value
        return replies[1:]

    def call(self, name: str, *args: Any) -> list[Any]:
        """Send a command and wait for every follower's reply."""
        self.send(name, *args, reply=True)
        return self.gather()

    def _collective(self, fn: Callable, *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, group=self.control, **kwargs)
        except Exception as exc:  # a rank is gone (or the group broke): the executor ends
            self.rank_lost(f"control channel failed: {exc!r}")

    # --- failure and shutdown -------------------------------------------------------------

    def rank_lost(self, reason: str) -> None:
        """A rank is gone: nothing this executor computes can be trusted or finished. Exit
        at once with the device-failure status; the controller moves the requests."""
        if self._closing:
            return
        log.critical("tensor-parallel rank lost (%s): the executor exits", reason)
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        os._exit(EXIT_DEVICE_FAILED)

    def _watch(self) -> None:
        while not self._closing:
            for rank, process in enumerate(self.processes, start=1):
                if not process.is_alive() and not self._closing:
                    self.rank_lost(f"rank {rank} (pid {process.pid}) exited: {process.exitcode}")
            time.sleep(_WATCH_INTERVAL)

    def close(self, timeout: float = 10.0) -> None:
        """A clean shutdown: the followers are told to stop and leave the group themselves,
        then rank 0 leaves it. A follower still running after ``timeout`` seconds is killed.
        (Killing live peers first and then tearing down gloo's group raced with gloo's own
        threads: the process could abort in teardown.)"""
        if self._closing:
            return
        self._closing = True  # a failure from here on is not a lost rank
        try:
            self.call("stop")
        except Exception as exc:  # a follower already gone: it is killed below
            log.warning("tensor-parallel followers did not stop cleanly: %r", exc)
        for process in self.processes:
            process.join(timeout=timeout)
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        if dist.is_initialized():
            dist.destroy_process_group()


def collective_guard(group: RankGroup, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (which runs collectives) with any failure inside ending the executor: once one
    rank has left a collective sequence the others are in, no later collective can be
    trusted to pair with its own (a follower would pair this step's all-reduce with the next
    one's), so the executor exits and the controller moves its requests, as for a lost rank."""

    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            group.rank_lost(f"a collective call failed: {exc!r}")
            raise

    return guarded
