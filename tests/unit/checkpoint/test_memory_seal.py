"""The MACs on the in-memory state's bytes that cross the network (memory.seal): the node's whole
state a rank sends to a rank whose node lacks it is decoded only when its MAC verifies, and a MAC is
bound to the key and to what the bytes are (another step's, or another part's, does not verify). The
replica ring and the shard exchange end to end: tests/unit/checkpoint/test_sharded_memory.py,
tests/unit/checkpoint/test_sharded_exchange.py."""

from __future__ import annotations

import pytest
import torch

from elasticd.checkpoint.memory import reader, seal, slots
from elasticd.checkpoint.memory.writer import Writer


@pytest.fixture(autouse=True)
def _key(monkeypatch):
    monkeypatch.setattr(seal, "_cached", [bytes(range(32))])


def _written(tmp_path, steps=(1,)) -> dict[int, bytearray]:
    w = Writer(str(tmp_path), 0)
    out = {}
    for step in steps:
        state = {"model": {"w": torch.full((64,), float(step))}, "step": step}
        w.write(step, state, world=1, rank=0)
        out[step] = reader.raw(str(tmp_path), step, 0)
    w.close()
    return out


def test_the_whole_state_received_is_decoded_only_when_its_mac_verifies(tmp_path):
    data = _written(tmp_path)[1]
    tag = seal.whole(data)
    assert torch.equal(reader.decode(data, 1, 0, tag)["state"]["model"]["w"], torch.ones(64))
    changed = bytearray(data)
    changed[slots.HEADER] ^= 0x01  # a bit of the tensor's bytes, on the way
    with pytest.raises(seal.Refused):
        reader.decode(changed, 1, 0, tag)
    with pytest.raises(seal.Refused):
        reader.decode(data, 1, 0, tag[:-1] + bytes([tag[-1] ^ 1]))


def test_a_mac_is_bound_to_the_key_the_step_and_the_part(tmp_path, monkeypatch):
    got = _written(tmp_path, (1, 2))
    with pytest.raises(ValueError, match="no longer holds step 1"):  # step 2's, with their MAC
        reader.decode(got[2], 1, 0, seal.whole(got[2]))
    with pytest.raises(seal.Refused):  # step 1's bytes, step 2's MAC
        reader.decode(got[1], 1, 0, seal.whole(got[2]))
    tag = seal.whole(got[1])
    assert tag != seal.slot_mac("replica", got[1][: slots.HEADER], got[1][slots.HEADER :])
    monkeypatch.setattr(seal, "_cached", [b"another job's key"])
    with pytest.raises(seal.Refused):
        reader.decode(got[1], 1, 0, tag)


def test_the_state_key_is_the_jobs_and_never_its_secret():
    """What the daemon hands its workers (names.STATE_KEY): the same on every node of a job,
    another for another job or secret, and not the secret that seals the store's values."""
    from elasticd.cluster import signing

    secret = b"s" * 32
    key = signing.state_key(secret, "job")
    assert len(key) == 32 and key != secret and key == signing.state_key(secret, "job")
    assert key not in (signing.state_key(secret, "job2"), signing.state_key(b"t" * 32, "job"))


def test_a_slot_mac_in_pieces_is_the_same_on_any_number_of_threads(monkeypatch):
    """A large slot is MAC'd in pieces on a few threads: the same MAC on one or three, and a
    change in any piece, or pieces swapped, does not verify."""
    monkeypatch.setattr(seal, "PIECE", 1000)
    body = bytearray(range(256)) * 20  # 5 pieces and a bit
    head = bytes(slots.HEADER)
    tags = []
    for threads in (1, 3):
        monkeypatch.setattr(seal, "THREADS", threads)
        tags.append(seal.slot_mac("replica", head, body))
    assert tags[0] == tags[1]
    changed = bytearray(body)
    changed[3500] ^= 0x80
    swapped = body[1000:2000] + body[:1000] + body[2000:]
    for other in (changed, swapped, body[:-1]):
        assert seal.slot_mac("replica", head, other) != tags[0]
