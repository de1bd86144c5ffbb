"""The sealed store as the rendezvous's parts see it: the store, the job's signer, the run's key
names, and the one log of values that failed. Each part (the run, the arrivals, the budget, the
closing, the barrier) gets this view and the few settings it needs, not the whole `Rendezvous`:
what it may read and write is what it is given.

Every value read here is opened against the full key it was read from (signing.py): a value
copied from another key, round or run never verifies. A value that fails is logged (one line per
key per 5 s, at most REJECTED_LOGS a REJECTED_WINDOW: a forger writing many keys in a loop must
not flood the log) and is None to the caller: never a decision, never a crash.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from elasticd import logs, names
from elasticd.cluster import kv as kvmod
from elasticd.cluster.signing import Signer

log = logs.get("elasticd.rendezvous")

REJECTED_LOGS = 20  # at most this many store_value_rejected lines per REJECTED_WINDOW seconds
REJECTED_WINDOW = 10.0


@dataclass
class Sealed:
    """The store and the seal, with the current run's key names (`scope`: "<job id>/<run>",
    moved by `enter_run` when a restarted store's host begins a new run)."""

    kv: kvmod.KV
    signer: Signer
    job: str  # the --rdzv-id
    scope: str = ""
    _logged: dict[str, float] = field(default_factory=dict, repr=False)
    # the window's start, the lines logged in it, the lines held back since the last one logged
    _window: list[float] = field(default_factory=lambda: [0.0, 0, 0], repr=False)

    @property
    def endpoint(self) -> str:
        return self.kv.endpoint

    def enter_run(self, run: str) -> None:
        """Every key from now on is under elasticd/<job>/<run>/."""
        self.scope = f"{self.job}/{run}"

    # --- key names ---

    def job_key(self, name: str) -> str:
        return names.job_key(self.scope, name)

    def round_key(self, number: int, name: str) -> str:
        return names.round_key(self.scope, number, name)

    def _tag(self, number: int) -> str:
        """Names the round's arrival keys: no one without the secret can make it, so no one can
        raise the counter or fill the records before the round's first node arrives."""
        return self.signer.mac(f"arrivals/{self.scope}/{number}", b"")[:16]

    def arrivals_key(self, number: int) -> str:
        return names.arrivals_key(self.scope, number, self._tag(number))

    def arrival_key(self, number: int, index: int) -> str:
        return names.arrival_key(self.scope, number, self._tag(number), index)

    # --- values ---

    def seal(self, key: str, payload: str) -> bytes:
        return self.signer.seal(key, payload)

    def open(self, key: str, raw: bytes | None, parse):
        """The parsed value, or None: absent, or (logged) not sealed for this key with the job's
        secret, or not of its form (a parser of values.py)."""
        if raw is None:
            return None
        data = self.signer.open(key, raw)
        value = None
        if data is not None:
            try:
                value = parse(data.decode())
            except (ValueError, UnicodeDecodeError, RecursionError):
                value = None
        if value is None:
            self.rejected(key, "bad signature" if data is None else "malformed")
        return value

    def read(self, key: str, parse, store: kvmod.KV | None = None):
        """`open` of what `store` (by default ours) holds at `key` now."""
        return self.open(key, (store or self.kv).get(key), parse)

    def rejected(self, key: str, why: str) -> None:
        """Log a value that failed, within the caps above."""
        now = time.monotonic()
        if now - self._logged.get(key, -60.0) < 5.0:
            return
        window = self._window
        if now - window[0] >= REJECTED_WINDOW:
            window[:] = [now, 0, window[2]]
        if window[1] >= REJECTED_LOGS:
            window[2] += 1
            return
        if len(self._logged) > 4096:
            self._logged.clear()
        self._logged[key] = now
        window[1] += 1
        log.warning(
            "store_value_rejected",
            key=key[:200],
            rejected=self.signer.rejected,
            why=why,
            suppressed=window[2],
        )
        window[2] = 0
