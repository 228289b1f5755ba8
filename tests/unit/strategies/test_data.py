"""A replica's share of a loader (``xtrainer/strategies/data.py``): disjoint, complete, shuffled alike."""

import pytest
import torch
from conftest import make_data
from torch.utils.data import DataLoader, DistributedSampler

from xtrainer.strategies.data import distribute_dataloader


@pytest.mark.parametrize("shuffle", [False, True])
def test_distribute_dataloader_shards_and_keeps_shuffle(shuffle):
    loader = DataLoader(make_data(n=20), batch_size=4, shuffle=shuffle, drop_last=False)
    shards = [distribute_dataloader(loader, 2, rank) for rank in range(2)]
    for rank, shard in enumerate(shards):
        assert isinstance(shard.sampler, DistributedSampler)
        assert shard.sampler.shuffle is shuffle and shard.sampler.rank == rank
        assert shard.batch_size == 4 and len(shard) == 3
    rows = [torch.cat([b[0] for b in shard]) for shard in shards]
    all_rows = torch.cat(rows)
    assert len(all_rows) == 20 and len({tuple(r.tolist()) for r in all_rows}) == 20  # disjoint, complete
    if shuffle:  # re-seeded per epoch: a new order, the same on every replica's view of the permutation
        first = [b[0] for b in shards[0]]
        shards[0].sampler.set_epoch(1)
        assert not all(torch.equal(a, b) for a, b in zip(first, [b[0] for b in shards[0]]))


def test_distribute_dataloader_refuses_custom_samplers():
    sampler = torch.utils.data.WeightedRandomSampler([1.0] * 20, 20)
    loader = DataLoader(make_data(n=20), batch_size=4, sampler=sampler)
    with pytest.raises(TypeError, match="DistributedSampler"):
        distribute_dataloader(loader, 2, 0)
