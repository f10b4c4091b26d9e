"""A tiny DNS server on 127.0.0.1 for discovery tests (UDP and TCP, A records)."""

from __future__ import annotations

import socket


class LocalDNSServer:
    """A tiny DNS server on 127.0.0.1 for discovery tests.

    Answers A queries for the names it holds (one record per address, TTL 0), NXDOMAIN for
    other names, an empty answer for other types. Serves UDP and TCP on the same port; with
    `truncate_over` set, a UDP answer with more records is sent truncated (TC), so that the
    client must ask again over TCP.
    """

    def __init__(self, truncate_over: int = 0):
        import threading

        self.records: dict[str, list[str]] = {}  # lower-case name -> IPv4 addresses
        self.truncate_over = truncate_over  # most A records in a UDP answer; 0 = no limit
        self.queries = 0  # questions answered
        self._udp, self._tcp = _bind_pair()
        self.port = self._udp.getsockname()[1]
        self._tcp.listen(8)
        self._closed = False
        for target in (self._serve_udp, self._serve_tcp):
            threading.Thread(target=target, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set(self, name: str, addresses: list[str]) -> None:
        self.records[name.lower().rstrip(".")] = list(addresses)

    def _answer(self, query: bytes, udp: bool) -> bytes:
        import struct

        qid, flags = struct.unpack("!HH", query[:4])
        pos, labels = 12, []
        while query[pos]:
            labels.append(query[pos + 1 : pos + 1 + query[pos]].decode().lower())
            pos += 1 + query[pos]
        qtype, _ = struct.unpack("!HH", query[pos + 1 : pos + 5])
        question = query[12 : pos + 5]
        name = ".".join(labels)
        self.queries += 1
        out_flags = 0x8400 | (flags & 0x0100)  # response, authoritative, recursion desired
        if name not in self.records:
            return struct.pack("!HHHHHH", qid, out_flags | 3, 1, 0, 0, 0) + question
        addresses = self.records[name] if qtype == 1 else []
        if udp and self.truncate_over and len(addresses) > self.truncate_over:
            return struct.pack("!HHHHHH", qid, out_flags | 0x0200, 1, 0, 0, 0) + question
        answers = b"".join(
            struct.pack("!HHHIH", 0xC00C, 1, 1, 0, 4) + socket.inet_aton(a) for a in addresses
        )
        return struct.pack("!HHHHHH", qid, out_flags, 1, len(addresses), 0, 0) + question + answers

    def _serve_udp(self) -> None:
        while not self._closed:
            try:
                data, peer = self._udp.recvfrom(4096)
                self._udp.sendto(self._answer(data, udp=True), peer)
            except OSError:
                return
            except Exception:  # a malformed query: ignore it
                continue

    def _serve_tcp(self) -> None:
        import struct

        while not self._closed:
            try:
                conn, _ = self._tcp.accept()
            except OSError:
                return
            with conn:
                try:
                    (length,) = struct.unpack("!H", conn.recv(2))
                    data = b""
                    while len(data) < length:
                        data += conn.recv(length - len(data))
                    reply = self._answer(data, udp=False)
                    conn.sendall(struct.pack("!H", len(reply)) + reply)
                except Exception:  # a broken client: drop it
                    continue

    def close(self) -> None:
        self._closed = True
        self._udp.close()
        self._tcp.close()


def _bind_pair(tries: int = 50) -> tuple[socket.socket, socket.socket]:
    """A UDP and a TCP socket bound to the same free port of 127.0.0.1. The kernel picks a
    free UDP port; that port may be taken for TCP (another test's connection), so another is
    tried until one is free for both."""
    for _ in range(tries):
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind(("127.0.0.1", 0))
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            tcp.bind(("127.0.0.1", udp.getsockname()[1]))
        except OSError:
            udp.close()
            tcp.close()
            continue
        return udp, tcp
    raise OSError(f"no port of 127.0.0.1 free for both UDP and TCP in {tries} tries")
