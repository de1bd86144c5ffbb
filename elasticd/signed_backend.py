"""torch's rendezvous state, signed and checked: a RendezvousBackend around the c10d one.

torch's DynamicRendezvousHandler keeps each round's state (participants, ranks, wait list,
keep-alives) as a pickle in the store and unpickles whatever it finds there about once a second:
anyone who can write that key would run code in the daemon. This backend hands the handler only
bytes that
- carry the job secret's HMAC and a sequence number no older than one it has already accepted
  (a recorded state cannot be replayed), and
- unpickle with nothing but the types torch's state is made of, into a state of the right shape.
Anything else is logged and replaced, for the handler, by the last state that passed, with the
store's current token: the handler's next write (a keep-alive, within a second) puts a good state
back over the bad one. The state is pickled by torch and unpickled again by torch; the bytes it
gets were proven to reference only the allowed classes, which is what makes that safe.
"""

from __future__ import annotations

import io
import pickle
import threading
import time
from datetime import datetime
from typing import Any

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    Token,
    _NodeDesc,
    _RendezvousState,
)

from elasticd import logs
from elasticd.signing import Signer

log = logs.get("elasticd.rendezvous")

MAX_STATE = 16 << 20  # bytes; 4,096 nodes' state is a few hundred KiB
_STATE_MODULE = _RendezvousState.__module__
_ALLOWED = {
    (_STATE_MODULE, "_RendezvousState"), (_STATE_MODULE, "_NodeDesc"),
    ("datetime", "datetime"), ("datetime", "timezone"), ("datetime", "timedelta"),
}
_FIELDS = {"round", "complete", "deadline", "closed", "participants", "wait_list", "redundancy_list",
           "last_heartbeats"}
SCOPE = "rendezvous-state"


class _Allowed(pickle.Unpickler):
    """An unpickler that builds only the classes a rendezvous state holds: no other callable
    (os.system, builtins.eval, ...) can be named, so nothing but these constructors runs."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a rendezvous state")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not part of a rendezvous state")


def _node(n: Any) -> bool:
    return (type(n) is _NodeDesc and type(n.addr) is str and len(n.addr) <= 1024
            and type(n.pid) is int and type(n.local_id) is int)


def _when(t: Any) -> bool:
    return type(t) is datetime


def check_state(data: bytes) -> str | None:
    """Why these bytes are not a rendezvous state torch could have written, or None if they are."""
    if len(data) > MAX_STATE:
        return f"larger than {MAX_STATE} bytes"
    try:
        state = _Allowed(io.BytesIO(data)).load()
    except Exception as e:  # noqa: BLE001 - any failure to load is a rejection, never a crash
        return f"{type(e).__name__}: {str(e)[:200]}"
    if type(state) is not _RendezvousState or set(vars(state)) != _FIELDS:
        return "not a rendezvous state"
    s = state
    ok = (type(s.round) is int and s.round >= 0 and type(s.complete) is bool and type(s.closed) is bool
          and (s.deadline is None or _when(s.deadline))
          and type(s.participants) is dict and all(_node(n) and type(r) is int for n, r in s.participants.items())
          and type(s.wait_list) is set and all(map(_node, s.wait_list))
          and type(s.redundancy_list) is set and all(map(_node, s.redundancy_list))
          and type(s.last_heartbeats) is dict
          and all(_node(n) and _when(t) for n, t in s.last_heartbeats.items()))
    return None if ok else "a rendezvous state with fields of the wrong type"


class SignedBackend(RendezvousBackend):
    """Wraps a RendezvousBackend (torch's C10dRendezvousBackend): signs what it writes, and gives
    the handler only states that verify (see the module docstring)."""

    def __init__(self, inner: RendezvousBackend, signer: Signer) -> None:
        self._inner, self._signer = inner, signer
        self._lock = threading.Lock()
        self._seq = 0  # the highest sequence number accepted
        self._good = pickle.dumps(_RendezvousState())  # the last state accepted
        self._logged = 0.0

    @property
    def name(self) -> str:
        return self._inner.name

    def get_state(self) -> tuple[bytes, Token] | None:
        got = self._inner.get_state()
        if got is None:
            return None
        raw, token = got
        return self._accept(raw), token

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        with self._lock:
            seq = self._seq + 1  # the store holds our _seq now, or the write fails on its token
        sealed = self._signer.seal(SCOPE, b"%d\n" % seq + state)
        got = self._inner.set_state(sealed, token)
        if got is None:
            return None
        raw, new_token, written = got
        return self._accept(raw), new_token, written

    def _accept(self, raw: bytes) -> bytes:
        payload = self._signer.open(SCOPE, raw)
        why = "no valid signature (another secret, or not written by a node of this job)"
        if payload is not None:
            head, _, state = payload.partition(b"\n")
            seq = int(head) if head.isdigit() and len(head) < 20 else -1
            with self._lock:
                if seq < self._seq:
                    why = f"sequence {seq} is older than {self._seq} (a replayed state)"
                elif (why := check_state(state)) is None:  # type: ignore[assignment]
                    self._seq, self._good = seq, state
                    return state
        self._reject(why)
        return self._good

    def _reject(self, why: str) -> None:
        now = time.monotonic()
        if now - self._logged >= 5.0:  # a forger writing in a loop must not flood the log
            self._logged = now
            log.warning("rdzv_state_rejected", why=why, rejected=self._signer.rejected)

