"""A run's configuration checked whole before anything is built (``xtrainer/config/building.py``:
``plan``, ``check_run``): every place, one line naming the key. Nothing trains."""

from typing import Any, List, Optional, Sequence, Union

import pytest
from torch import nn

from xtrainer.callbacks import EarlyStopping
from xtrainer.config import ConfigError, check_run, load, plan
from xtrainer.module import XModule

HERE = __name__  # this module, importable by name as the configurations below name it


class Tiny(XModule):
    def __init__(self, width: int = 4, rate: float = 0.1, name: str = "tiny", head: Optional[nn.Module] = None,
                 layers: Optional[List[nn.Module]] = None, loss: Union[nn.MSELoss, nn.L1Loss, None] = None,
                 blocks: Sequence[nn.Module] = (), anything: Any = None, untyped=None,
                 options: Optional[dict] = None) -> None:
        super().__init__()
        self.width, self.head, self.layers, self.loss, self.blocks = width, head, layers, loss, blocks


class Loaders:
    def train_dataloader(self):
        return []


def expect(where: str, message: str):
    """``pytest.raises`` for a ``ConfigError`` matching ``message``, checked to be one line."""
    class OneLine:
        def __enter__(self):
            self.raises = pytest.raises(ConfigError, match=message)
            self.info = self.raises.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self.raises.__exit__(*exc)
            assert "\n" not in str(self.info.value) and str(self.info.value).startswith(where)
            return handled
    return OneLine()


# ---- a run's configuration: every place, nothing built -------------------------------------------
def run(*items):
    return load([f"model._target_={HERE}.Tiny", *items])


def test_plan_checks_every_place_and_builds_nothing():
    checked = plan(run(f"data._target_={HERE}.Loaders", "trainer.strategy=xla_ddp",
                       "trainer.callbacks=[{_target_: xtrainer.callbacks.EarlyStopping, monitor: val_loss}]",
                       "trainer.logger={_target_: xtrainer.loggers.CSVLogger, save_dir: runs}"))
    assert checked.model.cls is Tiny and checked.data.cls is Loaders and checked.strategy == "xla_ddp"
    assert [t.cls for t in checked.callbacks] == [EarlyStopping] and checked.logger.cls.__name__ == "CSVLogger"
    strategy = plan(run("trainer.strategy={name: xla_fsdp, reshard_after_forward: false}")).strategy
    assert strategy.cls.name == "xla_fsdp" and strategy.kwargs == {"reshard_after_forward": False}


@pytest.mark.parametrize("items, message", [
    ([f"trainer.callbacks=[{{_target_: {HERE}.Tiny}}]"],
     r"^trainer.callbacks\[0\]._target_='unit.config.test_building.Tiny' is refused: .* here a Callback subclass"),
    ([f"trainer.logger={{_target_: {HERE}.Tiny}}"], r"^trainer.logger._target_=.* here a Logger subclass"),
    (["trainer.logger=5"], r"^trainer.logger=5: give true, false, a \{_target_: ...\} or a list of them"),
    ([f"trainer.strategy={{_target_: {HERE}.Tiny}}"], r"^trainer.strategy._target_=.* here a Strategy subclass"),
    (["trainer.strategy={name: xla_ddp, _target_: xtrainer.strategies.XlaDDP}"],
     r"^trainer.strategy has both name and _target_"),
    (["trainer.strategy={name: xla_dpp}"], r"^trainer.strategy.name='xla_dpp': use one of"),
    (["trainer.strategy=xla_dpp"], r"^trainer.strategy: .*xla_dpp"),
    (["trainer.max_time={_target_: torch.nn.ReLU}"],
     r"^trainer.max_time._target_='torch.nn.ReLU' is refused: trainer.max_time takes a plain value"),
    (["trainer.max_epochs={_target_: torch.nn.ReLU}"], r"^trainer.max_epochs=\{'_target_': 'torch.nn.ReLU'\} is not a "
                                                       r"valid int"),
    (["strategy=xla_ddp", "trainer.strategy=xla_ddp"], r"^Both strategy and trainer.strategy are set"),
    (["model.width=wide"], r"^model.width='wide' is not a valid int"),
    (["data={batch_size: 2}"], r"^data needs a _target_"),
    (["model.api_token='***'"], r"^model.api_token='\*\*\*' is a secret the saved configuration does not hold"),
])
def test_plan_refuses_in_one_line_naming_the_key(items, message):
    with expect("", message):
        plan(run(*items), "fit")


@pytest.mark.parametrize("items, message", [
    (["trainer.strategy={name: xla_fsdp, reshard: false}"], r"^trainer.strategy: .*reshard"),
    (["trainer.strategy={name: xla_fsdp, auto_wrap_policy: 0}"], r"^trainer.strategy: auto_wrap_policy=0: a "
                                                                 r"parameter count is at least 1"),
    (["trainer.max_epochs=-2"], r"^trainer: .*max_epochs"),
])
def test_check_run_builds_xtrainers_own_classes_and_refuses_what_they_refuse(items, message):
    """What only a constructor can tell (a strategy's keyword arguments, the Trainer's checks),
    refused in one line naming the place; the model, a class of your own, is not built."""
    with expect("", message):
        check_run(run(*items))


def test_a_zero_batch_limit_of_the_stage_is_refused():
    with expect("trainer.limit_val_batches", r"trainer.limit_val_batches=0 leaves no batches to validate"):
        plan(run("trainer.limit_val_batches=0"), "validate")
    plan(run("trainer.limit_val_batches=0"), "fit")  # fit without validation is fine
