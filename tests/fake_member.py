"""A fake etcd member for the tests: a threaded loopback server that speaks just enough HTTP/1.1
to read a request and lets the test answer it however it likes (crafted JSON, bad framing, a
trickle, silence, a closed connection), over plain TCP or TLS. Every wait in it is bounded and
`close()` ends every connection, so a test never hangs on it."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import threading
from collections.abc import Callable

# handler(member, conn, path, body) -> whether to keep the connection for another request
Handler = Callable[["FakeMember", socket.socket, str, dict], bool]


class FakeMember:
    def __init__(self, handler: Handler, tls: ssl.SSLContext | None = None):
        self.handler = handler
        self.tls = tls
        self.stopping = threading.Event()
        self.requests: list[tuple[str, dict]] = []  # (path, JSON body) of each request, in order
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.endpoint = f"127.0.0.1:{self.port}"
        self._spawn(self._accept)

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self._conns.add(conn)
            self._spawn(self._serve, conn)

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(5)
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
                with self._lock:
                    self._conns.add(conn)
            while not self.stopping.is_set():
                request = read_request(conn)
                if request is None:
                    return
                path, body = request
                self.requests.append((path, body))
                if not self.handler(self, conn, path, body):
                    return
        except (OSError, ValueError):
            return
        finally:
            conn.close()

    def sleep(self, seconds: float) -> bool:
        """Wait (a handler's pause); False when the member is closing."""
        return not self.stopping.wait(seconds)

    def close(self) -> None:
        self.stopping.set()
        try:
            self.sock.shutdown(
                socket.SHUT_RDWR
            )  # wakes the accepting thread (close alone does not)
        except OSError:
            pass
        self.sock.close()
        with self._lock:
            for c in self._conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for t in self._threads:
            t.join(5)

    def __enter__(self) -> FakeMember:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_request(conn: socket.socket) -> tuple[str, dict] | None:
    """(path, JSON body) of the next request, None at the end of the connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        body += chunk
    try:
        parsed = json.loads(body) if body else {}
    except ValueError:
        parsed = {}
    return lines[0].split(" ")[1], parsed


def response(body: bytes, status: str = "200 OK", headers: tuple[str, ...] = ()) -> bytes:
    """A whole HTTP/1.1 reply with its Content-Length."""
    head = [
        f"HTTP/1.1 {status}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        *headers,
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def json_reply(obj) -> bytes:
    return response(json.dumps(obj).encode())


def b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def healthy_reply(path: str, body: dict, store: dict[bytes, bytes] | None = None) -> dict:
    """What a healthy etcd 3.4 gateway answers to elasticd's requests (a tiny in-memory store)."""
    store = {} if store is None else store
    header = {"cluster_id": "1", "member_id": "2", "revision": "7", "raft_term": "2"}

    def read(key: str) -> dict:
        value = store.get(base64.b64decode(key))
        kvs = (
            []
            if value is None
            else [
                {
                    "key": key,
                    "value": b64(value),
                    "version": "1",
                    "mod_revision": "5",
                    "create_revision": "5",
                }
            ]
        )
        return {"header": header, **({"kvs": kvs, "count": "1"} if kvs else {})}

    if path == "/v3/kv/range":
        return read(body.get("key", ""))
    if path == "/v3/kv/put":
        store[base64.b64decode(body.get("key", ""))] = base64.b64decode(body.get("value", ""))
        return {"header": header}
    if path == "/v3/kv/txn":  # reads only (multi_get), or a compare_set that always succeeds
        return {
            "header": header,
            "succeeded": True,
            "responses": [
                {"response_range": read(op["request_range"]["key"])}
                if "request_range" in op
                else {"response_put": {}}
                for op in body.get("success", [])
            ],
        }
    if path == "/v3/auth/authenticate":
        return {"header": header, "token": "tok.1"}
    if path == "/v3/watch":
        return {"result": {"header": header, "created": True}}
    return {"header": header, "version": "3.4.23", "leader": "2"}


# --- handlers the tests share ---


def healthy(store: dict | None = None):
    store = {} if store is None else store

    def handler(member, conn, path, body):
        conn.sendall(json_reply(healthy_reply(path, body, store)))
        return True

    return handler


def trickle(head: bytes, every: float = 0.1, answered: tuple[str, ...] = ()):
    """A member that sends `head`, then a space every `every` seconds (50 of them at most: bounded
    even for a client that waits on each byte), to every request but those to `answered` paths,
    which it answers as a healthy member."""

    def handler(member, conn, path, body):
        if path in answered:
            conn.sendall(json_reply(healthy_reply(path, body)))
            return True
        conn.sendall(head)
        for _ in range(50):
            if not member.sleep(every):
                return False
            conn.sendall(b" ")
        return False

    return handler
