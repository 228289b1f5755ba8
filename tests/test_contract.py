"""Contracts that tie the parts together: the Trainer's settings and the config schema agree,
hook names come from the base classes, and every registered strategy fits, saves, and validates
from its own checkpoint (a new strategy is covered by registering it)."""

import dataclasses
import inspect
import os

import pytest
from conftest import Regressor, make_loader

from xtrainer import Trainer
from xtrainer.callbacks import Callback
from xtrainer.callbacks.base import CALLBACK_HOOKS
from xtrainer.config import TrainerConfig
from xtrainer.module import MODULE_HOOKS
from xtrainer.settings import TrainerSettings
from xtrainer.strategies import STRATEGIES


def test_the_trainers_arguments_and_the_config_schema_are_one_dataclass():
    params = inspect.signature(Trainer.__init__).parameters
    settings = {f.name: f.default for f in dataclasses.fields(TrainerSettings)}
    objects = ("self", "strategy", "callbacks", "logger")
    refused = ("plugins", "model_registry", "unexpected")  # taken only to be refused with a message
    own = {name: p.default for name, p in params.items() if name not in objects + refused}
    assert own == settings  # same names, same defaults: a new argument is a new field
    assert issubclass(TrainerConfig, TrainerSettings)
    assert {f.name for f in dataclasses.fields(TrainerConfig)} == set(settings) | {"strategy", "callbacks", "logger"}


def test_every_module_hook_is_a_callback_hook_and_misspelt_hooks_are_refused(trainer_kwargs):
    assert MODULE_HOOKS and MODULE_HOOKS <= CALLBACK_HOOKS  # the Trainer calls both by one name
    assert all(callable(getattr(Callback, name)) for name in CALLBACK_HOOKS)

    class Typo(Regressor):
        def on_train_epoch_ned(self):
            pass

    with pytest.raises(AttributeError, match="on_train_epoch_ned looks like a hook.*on_train_epoch_end"):
        Trainer(max_epochs=1, **trainer_kwargs).fit(Typo(), make_loader())


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_registered_strategy_fits_saves_and_validates_from_its_checkpoint(tmp_path, name):
    trainer = Trainer(strategy=name, max_epochs=1, default_root_dir=str(tmp_path), enable_progress_bar=False,
                      logger=False)
    model = Regressor()
    trainer.fit(model, make_loader(), make_loader(n=16, seed=1))
    assert trainer.global_step == 8 and "val_loss" in trainer.callback_metrics
    last = os.path.realpath(os.path.join(trainer.log_dir, "checkpoints", "last.ckpt"))
    assert last.endswith("epoch=0-step=8.ckpt")
    again = Trainer(strategy=name, default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False)
    [metrics] = again.validate(Regressor(), make_loader(n=16, seed=1), ckpt_path="last")
    assert again.ckpt_path == last
    assert metrics["val_loss"] == pytest.approx(trainer.callback_metrics["val_loss"], rel=1e-5)
