"""Where the executors are (and the other controllers, peers.py): static addresses, DNS names
and files, re-read periodically.

- static (`--executor host:port`): always part of the fleet.
- DNS (`--executor-dns name:port`): every A/AAAA record of the name is one executor, as a
  Kubernetes headless Service answers with one address per ready pod. Re-resolved every
  `discovery_interval` seconds, through the system resolver or `--dns-server host:port`.
- files (`--executor-file path`): one host:port per line (# starts a comment), re-read every
  interval; for fleets managed by other tools.

A source that fails to answer (timeout, server failure, unreadable file) keeps its last answer.
An address must be missing from `MISSES_TO_LEAVE` rounds in a row before it leaves, so that one
odd answer does not drain an executor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from controller.fleet import dns
from controller.settings import ControllerConfig

log = logging.getLogger(__name__)

MISSES_TO_LEAVE = 2  # rounds an address must be missing before it leaves


@dataclass
class Source:
    """One place executors are listed."""

    kind: str  # "static", "dns" or "file"
    spec: str  # the address, "name:port" or the file path


def split_host_port(spec: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"; ValueError when malformed."""
    host, sep, port = spec.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{spec!r} is not host:port")
    return host.strip("[]"), int(port)


def join_host_port(host: str, port: int) -> str:
    """An address gRPC can dial: IPv6 literals in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def read_address_file(path: str) -> set[str]:
    """The host:port entries of an address file."""
    found = set()
    with open(path) as f:
        for line in f:
            entry = line.split("#", 1)[0].strip()
            if entry:
                host, port = split_host_port(entry)
                found.add(join_host_port(host, port))
    return found


def executor_sources(config: ControllerConfig) -> list[Source]:
    """Where the executors are listed."""
    return (
        [Source("static", a) for a in config.executors]
        + [Source("dns", d) for d in config.executor_dns]
        + [Source("file", f) for f in config.executor_files]
    )


def peer_sources(config: ControllerConfig) -> list[Source]:
    """Where the other controllers are listed (their HTTP addresses)."""
    return (
        [Source("static", a) for a in config.peers]
        + [Source("dns", d) for d in config.peer_dns]
        + [Source("file", f) for f in config.peer_files]
    )


class Discovery:
    """Resolves every source into the current set of addresses (the executors' unless other
    `sources` are given: the peers', peers.py)."""

    def __init__(self, config: ControllerConfig, sources: list[Source] | None = None):
        self.sources: list[Source] = executor_sources(config) if sources is None else sources
        for source in self.sources:
            if source.kind == "dns":
                split_host_port(source.spec)  # fail at startup, not at the first round
        self.nameserver = split_host_port(config.dns_server) if config.dns_server else None
        self.timeout = max(1.0, min(config.discovery_interval, 5.0))  # per query
        self._last: dict[int, set[str]] = {}  # source index -> its last good answer
        self._present: dict[str, str] = {}  # address -> source kind, as last returned
        self._misses: dict[str, int] = {}  # address -> rounds missing in a row

    @property
    def dynamic(self) -> bool:
        """Whether any source can change (so it must be re-read)."""
        return any(s.kind != "static" for s in self.sources)

    async def _resolve_source(self, source: Source) -> set[str]:
        if source.kind == "static":
            return {source.spec}
        if source.kind == "file":
            return read_address_file(source.spec)
        host, port = split_host_port(source.spec)
        ips = await dns.resolve(host, self.nameserver, self.timeout)
        return {join_host_port(ip, port) for ip in ips}

    async def resolve(self) -> dict[str, str]:
        """The executors now: address -> the kind of source that lists it."""
        found: dict[str, str] = {}
        for index, source in enumerate(self.sources):
            try:
                addresses = await self._resolve_source(source)
                self._last[index] = addresses
            except Exception as exc:  # keep the last answer
                addresses = self._last.get(index, set())
                log.warning(
                    "discovery: %s %s failed (%s); keeping %d addresses",
                    source.kind,
                    source.spec,
                    exc,
                    len(addresses),
                )
            for address in addresses:
                found.setdefault(address, source.kind)
        result = dict(found)
        misses: dict[str, int] = {}
        for address, kind in self._present.items():
            if address not in found:
                count = self._misses.get(address, 0) + 1
                if count < MISSES_TO_LEAVE:  # keep it one more round
                    misses[address] = count
                    result[address] = kind
        self._misses = misses
        self._present = result
        return dict(result)
