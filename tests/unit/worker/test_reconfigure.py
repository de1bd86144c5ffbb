"""worker/reconfigure.py's groups at re-entry: the failed generation's subgroups dropped, and
new_group's count started where every rank of the new generation starts it."""

from __future__ import annotations

import torch.distributed as dist

from elasticd.worker import reconfigure


def test_fresh_subgroups_drops_the_old_groups_and_names_new_ones_per_generation(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        old = dist.new_group(backend="gloo")
        assert reconfigure.subgroups(dist) == [old]
        reconfigure.fresh_subgroups(dist, 2)
        assert reconfigure.subgroups(dist) == []
        new = dist.new_group(backend="gloo")
        assert new.group_name == str(1 + 2 * reconfigure.GROUPS_PER_GENERATION)
        assert reconfigure.subgroups(dist) == [new]
    finally:
        dist.destroy_process_group()
