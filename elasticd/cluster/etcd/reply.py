"""Reading a member's HTTP reply under one deadline and a size bound: a member trickling a byte at
a time cannot stretch the reply past its attempt's deadline (as it could a timeout per recv), and
a Content-Length of 10^13 or a chunk size of -1 cannot fill the memory (at most `MAX_REPLY`
bytes).
"""

from __future__ import annotations

import http.client
import io
import socket
import time

from elasticd.cluster import signing

# Bytes of a reply a member may send: one value as large as a sealed signing.MAX_VALUE, in base64,
# and a mebibyte for the rest (JSON, header). A larger one is a failed attempt, never read whole.
MAX_REPLY = (signing.MAX_VALUE + signing.MAC_HEX + 1) * 4 // 3 + 1024 * 1024
_FRAMING = 1024 * 1024  # bytes of status line, headers and chunk sizes a reply may add


class Reader(io.RawIOBase):
    """A socket's bytes as http.client reads a reply, bounded: each read waits only for what is
    left of one deadline (a member trickling a byte at a time cannot stretch the reply past it,
    as it could a timeout per recv), and no more than a reply's bytes come through (a chunk size
    of -1 or a Content-Length of 10^13 cannot fill the memory)."""

    def __init__(self, sock: socket.socket, deadline: float):
        super().__init__()
        self._sock = sock
        self._io = sock.makefile("rb", buffering=0)
        self.limit(deadline)

    def limit(self, deadline: float) -> None:
        """From now on: read by `deadline`, at most a whole reply's bytes."""
        self.deadline = deadline
        self.budget = MAX_REPLY + _FRAMING

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._io.fileno()

    def readinto(self, buffer) -> int | None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        if self.budget <= 0:
            raise ValueError(f"a reply of more than {MAX_REPLY} bytes")
        timeout = self._sock.gettimeout()
        if timeout is None or timeout > left:  # 0 (a look without waiting) stays 0
            self._sock.settimeout(left)
        n = self._io.readinto(memoryview(buffer).cast("B")[: self.budget])
        self.budget -= n or 0
        return n

    def close(self) -> None:
        self._io.close()
        super().close()


class _Timed:
    """A socket as an http.client response takes it in: its file is a Reader."""

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.deadline = sock, deadline

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(Reader(self.sock, self.deadline))


def response(sock: socket.socket, *args, deadline: float, **kwargs) -> http.client.HTTPResponse:
    """http.client's response, read under one deadline for the whole of it (conn.response_class)."""
    return http.client.HTTPResponse(_Timed(sock, deadline), *args, **kwargs)


def body(resp: http.client.HTTPResponse) -> bytes:
    """A reply's whole body, read in pieces; ValueError past MAX_REPLY (a Content-Length above it
    before a byte is read), IncompleteRead when it ends before its Content-Length."""
    if resp.length is not None and resp.length > MAX_REPLY:
        raise ValueError(
            f"a reply of {resp.length} bytes, more than the {MAX_REPLY} a member may send"
        )
    pieces, size = [], 0
    while piece := resp.read(65536):
        size += len(piece)
        if size > MAX_REPLY:
            raise ValueError(f"a reply of more than {MAX_REPLY} bytes")
        pieces.append(piece)
    if resp.length:  # http.client returns what came when the connection ends early
        raise http.client.IncompleteRead(b"".join(pieces), resp.length)
    return b"".join(pieces)


def left(end: float) -> float:
    left = end - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left
