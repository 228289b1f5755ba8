"""Config loading, the sampler swap for several replicas, the strategy registry."""

from dataclasses import dataclass, field

import pytest
import torch
from conftest import make_data
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, DistributedSampler

from xtrainer.config import ConfigError, TrainerConfig, load_config, save_config, trainer_kwargs
from xtrainer.strategies import STRATEGIES, Strategy, XlaNative, resolve_strategy
from xtrainer.strategies.data import distribute_dataloader


@dataclass
class Model:
    hidden: int = 8
    lr: float = 0.1


@dataclass
class Config:
    model: Model = field(default_factory=Model)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def test_yaml_then_command_line(tmp_path):
    yaml = tmp_path / "run.yaml"
    yaml.write_text("model:\n  hidden: 32\ntrainer:\n  max_epochs: 3\n  precision: bf16\n")
    cfg = load_config(Config, ["--config", str(yaml), "model.lr=0.5", "trainer.max_epochs=7"])
    assert (cfg.model.hidden, cfg.model.lr) == (32, 0.5)
    assert cfg.trainer.max_epochs == 7 and cfg.trainer.precision == "bf16"
    kwargs = trainer_kwargs(cfg.trainer)
    assert kwargs["max_epochs"] == 7 and kwargs["detect_nonfinite"] == "raise"
    path = save_config(cfg, tmp_path / "run")
    assert OmegaConf.load(path).model.lr == 0.5


def test_a_custom_schema_gets_the_same_checks(tmp_path):
    with pytest.raises(ConfigError, match="Did you mean 'trainer.max_epochs'\\? Valid keys: .*model.hidden"):
        load_config(Config, ["trainer.max_epoch=3"])
    with pytest.raises(ConfigError, match="model.hidden='big' is not a valid int"):
        load_config(Config, ["model.hidden=big"])
    with pytest.raises(ConfigError, match="Unexpected argument '--epochs'"):
        load_config(Config, ["--epochs", "3"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Config, ["--config", str(tmp_path / "nope.yaml")])
    tagged = tmp_path / "tagged.yaml"
    tagged.write_text("model:\n  hidden: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match="tagged.yaml', line 2, column 11: the YAML tag '!!python/object/apply"):
        load_config(Config, ["--config", str(tagged)])


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


def test_strategy_registry():
    assert isinstance(resolve_strategy("xla_native"), XlaNative)
    custom = XlaNative()
    assert resolve_strategy(custom) is custom
    assert all(issubclass(cls, Strategy) and cls.name == name for name, cls in STRATEGIES.items())
