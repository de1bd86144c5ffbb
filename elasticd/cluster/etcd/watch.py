"""`wait` on etcd: a watch of the key from the revision after a read, streamed on a connection
of its own (`start`), read until the key's first put (`next_put`); each thread's open watch
kept between the slices of its wait (`Streams`) and renewed every WATCH_RENEW seconds; read
with select.
"""

from __future__ import annotations

import functools
import http.client
import json
import re
import select
import ssl
import threading
import time
from dataclasses import dataclass, field

from elasticd.cluster.etcd import reply, wire
from elasticd.cluster.etcd.connections import shut
from elasticd.cluster.etcd.errors import Failed, cause_of, one_line

# Seconds a watch runs before the key is read again and the watch renewed: how long a member
# that lost its cluster (or was cut off from us) without closing the stream can hide a put.
WATCH_RENEW = 2.0


def start(
    conn: http.client.HTTPConnection,
    key: str,
    start_revision: int,
    headers: dict,
    taken_by: float,
    patience: float,
    deadline: float,
) -> Stream | None:
    """A watch of `key` from `start_revision` on `conn` (a connection of its own to the member in
    use), which the member takes by `taken_by` (`patience` seconds from the start); None when
    `deadline` passed before it did. Failed
    when the member cannot take it (the caller reads again elsewhere). `conn` is closed unless
    the stream holds it."""
    try:
        body = {"create_request": {"key": wire.b64(key), "start_revision": str(start_revision)}}
        try:
            conn.sock.settimeout(reply.left(taken_by))
            conn.response_class = functools.partial(reply.response, deadline=taken_by)
            conn.request("POST", "/v3/watch", body=json.dumps(body).encode(), headers=headers)
            resp = conn.getresponse()
        except TimeoutError:
            if deadline - time.monotonic() <= 0:
                conn.close()
                return None
            raise Failed(
                f"watch: no answer within {patience:g} s", applied_maybe=False, cause="timeout"
            ) from None
        except Exception as e:  # noqa: BLE001 - whatever the member sends or does: it cannot take the watch
            raise Failed(f"watch: {one_line(e)}", applied_maybe=False, cause=cause_of(e)) from None
        if resp.status != 200:
            raise Failed(f"watch: HTTP {resp.status} {one_line(resp.reason)}", applied_maybe=False)
    except BaseException:
        conn.close()
        raise
    return Stream(key, conn, resp, time.monotonic() + WATCH_RENEW)


def next_put(st: Stream, until: float, attempt_cap: float) -> bool:
    """Read the stream until the key's first put (True) or `until` (False). Failed when the
    member fails, closes or cancels it, or sends what cannot be read: the stream is then
    given up and the key read again, so nothing half-read can hide a put. The waiting is
    select's: a read begins only once bytes are there, and what has begun to arrive must
    come whole within one attempt's time, at most reply.MAX_REPLY bytes of it (a socket file
    cannot be read again after a timeout, and http.client's chunked reader blocks for the
    next chunk at the end of each one)."""
    sock = st.conn.sock
    while True:
        if put_in(st, until + attempt_cap):
            return True
        left = until - time.monotonic()
        if left <= 0:
            return False
        try:
            reader = st.resp.fp.raw
            reader.limit(time.monotonic() + attempt_cap)
            sock.settimeout(0.0)
            try:
                waiting = st.resp.fp.peek(
                    1
                )  # bytes an earlier read took in, or any that came since
            except ssl.SSLWantReadError:  # TLS: nothing to decrypt yet (plain sockets give b"")
                waiting = b""
            if not waiting and not select.select([sock], [], [], left)[0]:
                return False
            sock.settimeout(attempt_cap)
            reader.limit(time.monotonic() + attempt_cap)
            st.pending += _payload(st.resp)
        except Failed:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the member sends or does: the stream is given up
            raise Failed(f"watch: {one_line(e)}", applied_maybe=False, cause=cause_of(e)) from None
        if len(st.pending) > reply.MAX_REPLY:
            raise Failed(
                f"watch: a message of more than {reply.MAX_REPLY} bytes",
                applied_maybe=False,
                cause="reply",
            )


class Streams:
    """Each thread's open watch, kept between the slices of its wait (a waiter of the next round
    may start before the last one has left: each thread has its own)."""

    def __init__(self) -> None:
        self._streams: dict[threading.Thread, Stream] = {}
        self._lock = threading.Lock()

    def mine(self) -> Stream | None:
        return self._streams.get(threading.current_thread())

    def keep(self, st: Stream) -> None:
        """Keep this thread's stream for its next slice; the streams of threads that have ended
        are closed here."""
        with self._lock:
            for thread in [t for t in self._streams if not t.is_alive()]:
                self._streams.pop(thread).conn.close()
            self._streams[threading.current_thread()] = st

    def end(self, st: Stream) -> None:
        with self._lock:
            if self._streams.get(threading.current_thread()) is st:
                del self._streams[threading.current_thread()]
        st.conn.close()

    def close_all(self) -> None:
        """Every stream ended now: the thread that owns one closes it (closing it under a reader
        could hand its number to a new file); one still read elsewhere is shut down, so its
        reader wakes at once and closes it."""
        with self._lock:
            streams, self._streams = self._streams, {}
        for thread, st in streams.items():
            if thread is threading.current_thread() or not thread.is_alive():
                st.conn.close()
            else:
                shut(st.conn.sock)


@dataclass
class Stream:
    """An open watch: its key, connection, streamed reply, when it is read afresh, and the
    bytes of a message not yet whole."""

    key: str
    conn: http.client.HTTPConnection
    resp: http.client.HTTPResponse
    renew_at: float
    pending: bytearray = field(default_factory=bytearray)


def put_in(st: Stream, end: float) -> bool:
    """Whether a whole message among the stream's pending bytes reports a put of the key (the
    messages read are dropped); Failed for one that cannot be read, or when reading them
    takes past `end` (a member may send a flood of them)."""
    start = 0
    try:
        while (newline := st.pending.find(b"\n", start)) >= 0:
            line, start = bytes(st.pending[start:newline]), newline + 1
            if line.strip() and _is_put(line):
                return True
            if time.monotonic() > end:
                raise Failed(
                    "watch: more messages than can be read in time",
                    applied_maybe=False,
                    cause="reply",
                )
        return False
    finally:
        del st.pending[:start]


_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")


def _payload(resp: http.client.HTTPResponse) -> bytes:
    """The next piece of a streamed reply's body: one chunk (chunked), or what has come."""
    fp = resp.fp
    if not resp.chunked:
        data = fp.read1(65536)
    else:
        text = fp.readline(256).split(b";")[0].strip() or b"0"
        if not _CHUNK_SIZE.fullmatch(text) or int(text, 16) > reply.MAX_REPLY:
            raise ValueError(f"a chunk size of {text[:20]!r}")
        size = int(text, 16)
        data = fp.read(size) if size else b""
        if len(data) < size or (size and fp.read(2) != b"\r\n"):
            raise ValueError("a chunk cut short")
    if not data:
        raise Failed("watch: the member closed the stream", applied_maybe=False, cause="dropped")
    return data


def _is_put(line: bytes) -> bool:
    """Whether one message of a watch stream reports a put of the key; Failed for an error, a
    cancelled or compacted watch, or what is not a message of that form."""
    try:
        msg = wire.obj(wire.parse(line), "a watch message")
        if "error" in msg:
            raise Failed(f"watch: {wire.error_text(msg)}", applied_maybe=False)
        result = wire.obj(msg.get("result") or {}, "a watch result")
        if any(
            wire.obj(event, "an event").get("type", "PUT") == "PUT"
            for event in wire.items(result, "events")
        ):
            return True
        if wire.field(result, "canceled") or wire.field(result, "compact_revision"):
            why = one_line(wire.field(result, "cancel_reason") or "compacted")
            raise Failed(f"watch canceled: {why}", applied_maybe=False)
        return False
    except Failed:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the line held: the stream is given up
        raise Failed(
            f"watch: a message that is not etcd's ({one_line(e)})",
            applied_maybe=False,
            cause="reply",
        ) from None
