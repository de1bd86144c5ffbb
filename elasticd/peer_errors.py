"""The words of an error a rank meets when another rank, or its node, went away first (the
transport's: gloo, NCCL, sockets). Shared by the daemon, which never takes such an error for the
cause of a job's failure while another came before (lifecycle/triage.py), and the workers, which
re-enter in place from it and from nothing else (worker/reconfigure.py `from_elsewhere`)."""

from __future__ import annotations

import re

CONSEQUENCE_TEXTS = re.compile(
    r"Connection (?:reset|closed) by peer|Broken pipe|\bECONNRESET\b|\bEPIPE\b|Connection refused"
    r"|remote process exited|communicator was aborted|\bDistNetworkError\b|Socket closed",
    re.IGNORECASE,
)


def consequence(exception: str | None) -> bool:
    """Whether an error's text is of the kind a rank dies of when another rank failed first (the
    peer's connection reset or closed, a broken pipe, NCCL's remote process gone)."""
    return bool(exception and CONSEQUENCE_TEXTS.search(exception))
