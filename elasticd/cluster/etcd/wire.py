"""The etcd v3 JSON gateway's wire form: keys and values in base64, and each reply decoded
strictly, as the gateway gives it (int64s as strings of digits, bytes in base64, a field at its
default left out). Anything else raises, which the caller counts as a failed attempt on that
member (`decoded`). Pure: no I/O.
"""

from __future__ import annotations

import base64
import json
import re

from elasticd.cluster.etcd.errors import Failed, one_line

# JSON items (',' '[' '{') a reply may hold: the largest of ours, a transaction of MAX_TXN_OPS
# reads, has about 2,000; millions of tiny ones would cost gigabytes once parsed.
MAX_ITEMS = 100_000


def parse(raw: bytes):
    """A member's JSON; ValueError when it holds more items than a reply of ours can (parsing
    millions of tiny ones would cost gigabytes), RecursionError when nested too deep."""
    if raw.count(b",") + raw.count(b"[") + raw.count(b"{") > MAX_ITEMS:
        raise ValueError(f"more than {MAX_ITEMS} JSON items")
    return json.loads(raw)


def decoded(decode, reply):
    """decode(reply); whatever it raises (a field missing, of another type, bad base64...) is a
    failed attempt on that member: it may have applied the request."""
    try:
        return decode(reply)
    except Exception as e:  # noqa: BLE001 - a reply that is not etcd's: never a traceback
        raise Failed(
            f"a reply that is not etcd's ({one_line(e)})", applied_maybe=True, cause="reply"
        ) from None


def b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode("ascii")


def field(d: dict, name: str):
    """A field of a reply by its proto name, or by protojson's camelCase (etcd 3.6's gateway)."""
    if name in d:
        return d[name]
    head, *rest = name.split("_")
    return d.get(head + "".join(p.title() for p in rest))


def obj(x, what: str = "a reply") -> dict:
    if not isinstance(x, dict):
        raise ValueError(f"{what} that is not a JSON object")
    return x


def items(d: dict, name: str) -> list:
    x = field(d, name)
    if x is None:
        return []
    if not isinstance(x, list):
        raise ValueError(f"{name} that is not a list")
    return x


def int64(d: dict, name: str) -> int:
    """An int64 field (a string of digits; 0 when left out)."""
    x = field(d, name)
    if x is None:
        return 0
    if isinstance(x, str) and x.isascii() and x.isdigit() and len(x) <= 19:
        x = int(x)
    if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < 2**63:
        raise ValueError(f"{name} that is not a number from 0 to 2^63-1")
    return x


def flag(d: dict, name: str) -> bool:
    x = field(d, name)
    if x is not None and not isinstance(x, bool):
        raise ValueError(f"{name} that is not true or false")
    return bool(x)


def header(reply) -> dict:
    """The header etcd puts in every reply."""
    return obj(field(obj(reply), "header"), "a header")


def status(reply) -> dict:
    header(reply)
    return reply


def _first_kv(range_reply: dict) -> dict | None:
    kvs = items(obj(range_reply, "a range"), "kvs")
    return obj(kvs[0], "a key-value") if kvs else None


def _value(range_reply: dict) -> bytes | None:
    kv_ = _first_kv(range_reply)
    if kv_ is None:
        return None
    value = kv_.get("value", "")
    if not isinstance(value, str):
        raise ValueError("a value that is not base64 text")
    return base64.b64decode(value, validate=True)


def _kv_int(range_reply: dict, name: str) -> int:
    kv_ = _first_kv(range_reply)
    return int64(kv_, name) if kv_ is not None else 0


def range_reply(reply) -> tuple[bytes | None, int, int]:
    revision = int64(header(reply), "revision")
    return _value(reply), _kv_int(reply, "mod_revision"), revision


def keys(reply) -> list[str]:
    """The keys of a keys-only range (one not text, or not ours, is left out)."""
    header(reply)
    kvs = field(reply, "kvs") or []
    if not isinstance(kvs, list):
        raise ValueError("kvs that is not a list")
    found = []
    for item in kvs:
        try:
            found.append(base64.b64decode(item["key"], validate=True).decode())
        except (KeyError, TypeError, ValueError):
            continue
    return found


def version(reply) -> int:
    header(reply)
    return _kv_int(reply, "version")


def prev_version(reply) -> int:
    header(reply)
    prev = field(reply, "prev_kv")
    return 0 if prev is None else int64(obj(prev, "prev_kv"), "version")


def reads(n: int, reply) -> list[bytes | None]:
    """The values of a transaction of n reads, in order."""
    header(reply)
    replies = items(reply, "responses")
    if len(replies) != n:
        raise ValueError(f"a transaction of {n} reads answered {len(replies)}")
    return [_value(field(obj(r, "a response"), "response_range")) for r in replies]


def txn_outcome(reply) -> tuple[bool, bytes | None]:
    """compare_set's transaction: whether it succeeded, else the key's value (its failure read)."""
    header(reply)
    if flag(reply, "succeeded"):
        return True, None
    replies = items(reply, "responses")
    return False, _value(
        field(obj(replies[0], "a response"), "response_range")
    ) if replies else None


_TOKEN = re.compile(r"[!-~]{1,4096}")  # printable ASCII, no space: it goes into a header as it is


def token(reply) -> str:
    token = obj(reply).get("token")
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        raise ValueError("an authentication token that is not one")
    return token


def error_text(reply) -> str:
    """The message of an error reply (text only: a member's nested JSON is not printed)."""
    if not isinstance(reply, dict):
        return ""
    err = reply.get("error")
    if isinstance(err, dict):  # a stream's error: {"error": {"grpc_code": 14, "message": ...}}
        err = err.get("message")
    text = next((m for m in (reply.get("message"), err) if isinstance(m, str) and m.strip()), None)
    return one_line(text) if text else ""
