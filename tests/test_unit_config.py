"""Configuration building on its own (``xtrainer.config``), nothing trained and nothing built but
the small classes below: each ``_target_`` checked against the base class its place expects,
nested ``_target_``s against the annotation of the parameter they fill, arguments against the
signature, and every refusal one line naming the key. The whole ``xtrainer fit`` path, with
files, exit codes and hostile YAML, is tests/test_config_safety.py and tests/test_cli.py."""

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Union

import pytest
from torch import nn

from xtrainer.callbacks import Callback, EarlyStopping
from xtrainer.config import ConfigError, check_run, instantiate, load, load_config, plan
from xtrainer.config.targets import Expected, Target, check_arguments, locate, place, resolve_target
from xtrainer.module import XModule

HERE = __name__  # this module, importable by name as the configurations below name it


class Tiny(XModule):
    def __init__(self, width: int = 4, rate: float = 0.1, name: str = "tiny", head: Optional[nn.Module] = None,
                 layers: Optional[List[nn.Module]] = None, loss: Union[nn.MSELoss, nn.L1Loss, None] = None,
                 blocks: Sequence[nn.Module] = (), anything: Any = None, untyped=None,
                 options: Optional[dict] = None) -> None:
        super().__init__()
        self.width, self.head, self.layers, self.loss, self.blocks = width, head, layers, loss, blocks


class Strict(XModule):
    def __init__(self, size: int) -> None:
        super().__init__()
        if size < 1:
            raise ValueError(f"size={size} must be positive")


class Loaders:
    def train_dataloader(self):
        return []


class NotACallback:
    pass


class Outer:
    class Inner(Callback):
        pass


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


# ---- each place's base class --------------------------------------------------------------------
@pytest.mark.parametrize("where, dotted", [
    ("model", f"{HERE}.Tiny"),
    ("data", f"{HERE}.Loaders"),  # a class with *_dataloader() methods
    ("data", "xtrainer.datamodule.XDataModule"),
    ("callbacks", "xtrainer.callbacks.EarlyStopping"),
    ("callbacks", f"{HERE}.Outer.Inner"),  # a nested class
    ("logger", "xtrainer.loggers.CSVLogger"),
    ("strategy", "xtrainer.strategies.XlaDDP"),
])
def test_a_class_of_the_type_its_place_expects_is_located(where, dotted):
    cls = locate(dotted, where, place(where))
    assert cls.__name__ == dotted.rpartition(".")[2]


@pytest.mark.parametrize("where, dotted, message", [
    ("model", f"{HERE}.Loaders", r"here an XModule subclass .*; test_unit_config.Loaders is not one\."),
    ("data", "xtrainer.callbacks.EarlyStopping", r"here an XDataModule subclass or a class with \*_dataloader"),
    ("callbacks", f"{HERE}.NotACallback", r"here a Callback subclass .* is not one"),
    ("logger", "xtrainer.callbacks.EarlyStopping", r"here a Logger subclass"),
    ("strategy", f"{HERE}.Tiny", r"here a Strategy subclass \(or a strategy's name"),
    ("model", "os.system", r"os is in Python's standard library, which holds none \(it was not imported\)"),
    ("model", "subprocess.Popen", r"subprocess is in Python's standard library"),
    ("model", f"{HERE}.expect", r"test_unit_config.expect is a function, not a class"),
    ("model", f"{HERE}.Tiny.forward", r"test_unit_config.Tiny.forward is a function, not a class"),
    ("model", f"{HERE}.pytest", r"test_unit_config.pytest is the module pytest, reached through test_unit_config"),
    ("model", f"{HERE}.HERE", r"test_unit_config.HERE is a str object, not a class"),
    ("model", f"{HERE}.Missing", r"module test_unit_config has no attribute 'Missing'"),
    ("model", f"{HERE}.Tiny.Missing", r"class test_unit_config.Tiny has no attribute 'Missing'"),
    ("model", "no_such_package.Model", r"no module 'no_such_package' can be imported"),
    ("model", "Tiny", r"is not a dotted class name"),
    ("model", "a.b-c", r"is not a dotted class name"),
    ("model", 42, r"model._target_=42 is not a dotted class name"),
    ("model", f"{HERE}.__class__", r"names with '__' parts are refused"),
])
def test_a_class_of_another_type_or_not_a_class_is_refused(where, dotted, message):
    with expect(f"{where}._target_=", message):
        locate(dotted, where, place(where))


def test_places_are_only_the_five():
    with pytest.raises(ValueError, match="no place 'trainer'"):
        place("trainer")


# ---- arguments: the signature and the annotations -----------------------------------------------
def test_arguments_are_checked_against_the_signature_nothing_is_built():
    target = resolve_target({"_target_": f"{HERE}.Tiny", "width": 8, "rate": 1, "name": "x"}, "model", place("model"))
    assert isinstance(target, Target) and target.cls is Tiny and target.kwargs == {"width": 8, "rate": 1, "name": "x"}
    model = target.build()
    assert isinstance(model, Tiny) and model.width == 8


@pytest.mark.parametrize("kwargs, message", [
    ({"widht": 8}, r"Unknown key 'model.widht': test_unit_config.Tiny takes width, rate, .* Did you mean 'width'"),
    ({"width": "wide"}, r"model.width='wide' is not a valid int \(an argument of test_unit_config.Tiny\)"),
    ({"width": True}, r"model.width=True is not a valid int"),
    ({"rate": "fast"}, r"model.rate='fast' is not a valid float"),
    ({"name": 3}, r"model.name=3 is not a valid str"),
])
def test_wrong_arguments_are_refused_naming_the_key(kwargs, message):
    with expect("", message):
        check_arguments(Tiny, kwargs, "model")


def test_a_required_argument_must_be_given_and_a_constructors_error_names_the_place():
    with expect("model.size", r"model.size is required by test_unit_config.Strict and has no value: set model.size"):
        resolve_target({"_target_": f"{HERE}.Strict"}, "model", place("model"))
    target = resolve_target({"_target_": f"{HERE}.Strict", "size": 0}, "model", place("model"))
    with expect("model: ", r"model: size=0 must be positive"):
        target.build()


def test_nested_targets_fill_parameters_annotated_with_a_class():
    spec = {"_target_": f"{HERE}.Tiny",
            "head": {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 1},
            "layers": [{"_target_": "torch.nn.ReLU"}, {"_target_": "torch.nn.Tanh"}],
            "loss": {"_target_": "torch.nn.L1Loss"},
            "blocks": [{"_target_": "torch.nn.Identity"}]}
    target = resolve_target(spec, "model", place("model"))
    assert isinstance(target.kwargs["head"], Target) and not target.is_own()
    model = target.build()
    assert isinstance(model.head, nn.Linear) and [type(m) for m in model.layers] == [nn.ReLU, nn.Tanh]
    assert isinstance(model.loss, nn.L1Loss) and isinstance(model.blocks[0], nn.Identity)


@pytest.mark.parametrize("key, value, message", [
    ("head", {"_target_": f"{HERE}.Loaders"}, r"model.head._target_='test_unit_config.Loaders' is refused: .* here "
                                              r"a torch.nn.modules.module.Module \(the annotation of the parameter"),
    ("loss", {"_target_": "torch.nn.MSELoss"}, None),
    ("loss", {"_target_": "torch.nn.Linear", "in_features": 1, "out_features": 1},
     r"here a torch.nn.modules.loss.MSELoss or a torch.nn.modules.loss.L1Loss"),
    ("layers", [{"_target_": "torch.nn.ReLU"}, {"_target_": "xtrainer.callbacks.EarlyStopping"}],
     r"model.layers\[1\]._target_='xtrainer.callbacks.EarlyStopping' is refused"),
    ("anything", {"_target_": "torch.nn.ReLU"}, r"model.anything._target_='torch.nn.ReLU' is refused: the parameter "
                                                r"'anything' of test_unit_config.Tiny has no class annotation \(it has "
                                                r"Any\)"),
    ("untyped", {"_target_": "torch.nn.ReLU"}, r"the parameter 'untyped' .* has no class annotation \(it has none\)"),
    ("options", {"_target_": "torch.nn.ReLU"}, r"has no class annotation"),
    ("options", {"inner": {"_target_": "torch.nn.ReLU"}}, r"model.options.inner._target_='torch.nn.ReLU' is refused: "
                                                          r"a _target_ fills a parameter whose annotation names a class"),
    ("head", {"in_features": 2}, None),  # a plain dict where a class is annotated: passed as it is
])
def test_nested_targets_must_fit_the_annotation_of_their_parameter(key, value, message):
    spec = {"_target_": f"{HERE}.Tiny", key: value}
    if message is None:
        resolve_target(spec, "model", place("model"))
        return
    with expect("model.", message):
        resolve_target(spec, "model", place("model"))


def test_instantiate_builds_against_a_base_of_your_own():
    stopper = instantiate({"_target_": "xtrainer.callbacks.EarlyStopping", "monitor": "val_loss"}, "stop", Callback)
    assert isinstance(stopper, EarlyStopping) and stopper.monitor == "val_loss"
    with expect("stop._target_=", r"here a xtrainer.callbacks.base.Callback subclass; .* is not one"):
        instantiate({"_target_": f"{HERE}.Tiny"}, "stop", Callback)
    with expect("stop needs", r"stop needs a _target_"):
        instantiate({"monitor": "val_loss"}, "stop", Callback)


def test_expected_accepts_subclasses_and_loader_classes_only_where_asked():
    assert Expected((XModule,), "a model").accepts(Tiny)
    assert not Expected((XModule,), "a model").accepts(Loaders)
    assert Expected((XModule,), "data", loader_methods=True).accepts(Loaders)
    assert not Expected((Callback,), "a callback").holds_standard_library_classes()


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
     r"^trainer.callbacks\[0\]._target_='test_unit_config.Tiny' is refused: .* here a Callback subclass"),
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


def test_max_epochs_minus_one_means_no_limit_as_in_lightning():
    from xtrainer.config.settings import TrainerSettings

    assert TrainerSettings(max_epochs=-1, max_steps=50).check().max_epochs == -1
    assert TrainerSettings(max_epochs=-1).check().max_epochs == -1  # max_steps or max_time ends it
    # Left out: Lightning's default, 1000 epochs, unless max_steps or max_time ends the fit
    assert TrainerSettings(max_steps=50).check().max_epochs == -1
    assert TrainerSettings(max_time="00:00:01:00").check().max_epochs == -1
    assert TrainerSettings().check().max_epochs == 1000
    with pytest.raises(ValueError, match="max_epochs=0 must be a positive int"):
        TrainerSettings(max_epochs=0).check()


def test_a_zero_batch_limit_of_the_stage_is_refused():
    with expect("trainer.limit_val_batches", r"trainer.limit_val_batches=0 leaves no batches to validate"):
        plan(run("trainer.limit_val_batches=0"), "validate")
    plan(run("trainer.limit_val_batches=0"), "fit")  # fit without validation is fine


# ---- a schema of your own --------------------------------------------------------------------------
@dataclass
class Sweep:
    lr: float = 0.1
    steps: int = 10
    tags: List[str] = field(default_factory=list)


def test_load_config_fills_a_schema_and_names_a_wrong_key():
    assert load_config(Sweep, ["lr=0.5", "tags=[a, b]"]) == Sweep(0.5, 10, ["a", "b"])
    with expect("", r"steps"):
        load_config(Sweep, ["step=3"])
    with expect("", r"steps='many' is not a valid int"):
        load_config(Sweep, ["steps=many"])
