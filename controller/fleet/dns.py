"""A small DNS stub resolver: A and AAAA records of one name from a chosen nameserver.

The system resolver (getaddrinfo) is used unless a nameserver is given: inside Kubernetes it
asks the cluster DNS, which answers a headless Service's name with one address per ready pod.
Asking a chosen nameserver directly serves setups (and tests) where the system resolver cannot
be pointed at it. Queries go over UDP; a truncated answer is asked again over TCP.
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import socket
import struct

QTYPE_A = 1  # IPv4 address record
QTYPE_AAAA = 28  # IPv6 address record
_FLAG_QR = 0x8000  # the message is a response
_FLAG_TC = 0x0200  # the response was truncated
_FLAG_RD = 0x0100  # recursion desired
_RCODE_NXDOMAIN = 3  # the name does not exist


class DNSError(RuntimeError):
    """The nameserver did not answer, or answered with an error."""


def encode_name(name: str) -> bytes:
    """A domain name in wire format (length-prefixed labels, then a zero byte)."""
    out = bytearray()
    for label in name.rstrip(".").split("."):
        raw = label.encode("idna") if label else b""
        if not 0 < len(raw) < 64:
            raise ValueError(f"bad DNS name {name!r}")
        out += bytes([len(raw)]) + raw
    return bytes(out + b"\0")


def skip_name(msg: bytes, pos: int) -> int:
    """Position just after the (possibly compressed) name starting at `pos`."""
    while True:
        if pos >= len(msg):
            raise DNSError("truncated name")
        length = msg[pos]
        if length == 0:
            return pos + 1
        if length & 0xC0 == 0xC0:  # a pointer ends the name
            return pos + 2
        pos += 1 + length


def build_query(qid: int, name: str, qtype: int) -> bytes:
    """One question, recursion desired."""
    return (
        struct.pack("!HHHHHH", qid, _FLAG_RD, 1, 0, 0, 0)
        + encode_name(name)
        + struct.pack("!HH", qtype, 1)
    )


def parse_response(msg: bytes, qid: int, qtype: int) -> tuple[list[str], bool]:
    """(addresses of type `qtype` in the answer section, truncated?) of a response."""
    if len(msg) < 12:
        raise DNSError("short response")
    rid, flags, qdcount, ancount, _, _ = struct.unpack("!HHHHHH", msg[:12])
    if rid != qid or not flags & _FLAG_QR:
        raise DNSError("response does not match the query")
    if flags & _FLAG_TC:
        return [], True
    rcode = flags & 0xF
    if rcode == _RCODE_NXDOMAIN:
        return [], False
    if rcode != 0:
        raise DNSError(f"nameserver answered rcode {rcode}")
    pos = 12
    for _ in range(qdcount):
        pos = skip_name(msg, pos) + 4
    family = socket.AF_INET if qtype == QTYPE_A else socket.AF_INET6
    size = 4 if qtype == QTYPE_A else 16
    found: list[str] = []
    for _ in range(ancount):
        pos = skip_name(msg, pos)
        rtype, rclass, _ttl, rdlength = struct.unpack("!HHIH", msg[pos : pos + 10])
        pos += 10
        rdata = msg[pos : pos + rdlength]
        pos += rdlength
        if rtype == qtype and rclass == 1 and rdlength == size:
            found.append(socket.inet_ntop(family, rdata))
    return found, False


def _exchange_udp(query: bytes, server: tuple[str, int], timeout: float) -> bytes:
    family = socket.AF_INET6 if ":" in server[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        sock.sendto(query, server)
        while True:
            data, _ = sock.recvfrom(65535)
            if data[:2] == query[:2]:  # ignore stray datagrams
                return data


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise DNSError("TCP answer cut short")
        buf += chunk
    return buf


def _exchange_tcp(query: bytes, server: tuple[str, int], timeout: float) -> bytes:
    with socket.create_connection(server, timeout=timeout) as sock:
        sock.sendall(struct.pack("!H", len(query)) + query)
        (length,) = struct.unpack("!H", _recv_exact(sock, 2))
        return _recv_exact(sock, length)


def query(name: str, qtype: int, server: tuple[str, int], timeout: float = 2.0) -> list[str]:
    """Addresses of one record type for `name`, asked of `server` (blocking)."""
    qid = random.randrange(1 << 16)
    msg = build_query(qid, name, qtype)
    try:
        found, truncated = parse_response(_exchange_udp(msg, server, timeout), qid, qtype)
        if truncated:
            found, _ = parse_response(_exchange_tcp(msg, server, timeout), qid, qtype)
    except (OSError, struct.error) as exc:
        raise DNSError(f"{server[0]}:{server[1]}: {exc!r}") from exc
    return found


async def resolve(
    name: str, nameserver: tuple[str, int] | None = None, timeout: float = 2.0
) -> list[str]:
    """Every IPv4 and IPv6 address of `name`, sorted; [] when the name does not exist.

    An IP literal resolves to itself. Raises DNSError (or OSError) when the answer is unknown,
    so that callers can keep what they knew.
    """
    try:
        return [str(ipaddress.ip_address(name))]
    except ValueError:
        pass
    if nameserver is None:
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(name, None, type=socket.SOCK_STREAM), timeout
            )
        except socket.gaierror as exc:
            if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", -5)):
                return []
            raise DNSError(f"{name}: {exc}") from exc
        return sorted({str(info[4][0]) for info in infos})
    found: list[str] = []
    for qtype in (QTYPE_A, QTYPE_AAAA):
        found += await asyncio.to_thread(query, name, qtype, nameserver, timeout)
    return sorted(set(found))
