"""``_target_``s on their own (``xtrainer/config/targets.py``), nothing trained and nothing built but the
small classes below: each checked against the base class its place expects, nested ones against the
annotation of the parameter they fill, arguments against the signature. The user-facing side
(files, exit codes, hostile YAML) is in tests/stories/cli/."""

from typing import Any, List, Optional, Sequence, Union

import pytest
from torch import nn

from xtrainer.callbacks import Callback, EarlyStopping
from xtrainer.config import ConfigError, instantiate
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
    ("model", f"{HERE}.Loaders", r"here an XModule subclass .*; unit.config.test_targets.Loaders is not one\."),
    ("data", "xtrainer.callbacks.EarlyStopping", r"here an XDataModule subclass or a class with \*_dataloader"),
    ("callbacks", f"{HERE}.NotACallback", r"here a Callback subclass .* is not one"),
    ("logger", "xtrainer.callbacks.EarlyStopping", r"here a Logger subclass"),
    ("strategy", f"{HERE}.Tiny", r"here a Strategy subclass \(or a strategy's name"),
    ("model", "os.system", r"os is in Python's standard library, which holds none \(it was not imported\)"),
    ("model", "subprocess.Popen", r"subprocess is in Python's standard library"),
    ("model", f"{HERE}.expect", r"unit.config.test_targets.expect is a function, not a class"),
    ("model", f"{HERE}.Tiny.forward", r"unit.config.test_targets.Tiny.forward is a function, not a class"),
    ("model", f"{HERE}.pytest", r"unit.config.test_targets.pytest is the module pytest, reached through "
                                r"unit.config.test_targets"),
    ("model", f"{HERE}.HERE", r"unit.config.test_targets.HERE is a str object, not a class"),
    ("model", f"{HERE}.Missing", r"module unit.config.test_targets has no attribute 'Missing'"),
    ("model", f"{HERE}.Tiny.Missing", r"class unit.config.test_targets.Tiny has no attribute 'Missing'"),
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
    ({"widht": 8}, r"Unknown key 'model.widht': unit.config.test_targets.Tiny takes width, rate, .* Did you mean "
                   r"'width'"),
    ({"width": "wide"}, r"model.width='wide' is not a valid int \(an argument of unit.config.test_targets.Tiny\)"),
    ({"width": True}, r"model.width=True is not a valid int"),
    ({"rate": "fast"}, r"model.rate='fast' is not a valid float"),
    ({"name": 3}, r"model.name=3 is not a valid str"),
])
def test_wrong_arguments_are_refused_naming_the_key(kwargs, message):
    with expect("", message):
        check_arguments(Tiny, kwargs, "model")


def test_a_required_argument_must_be_given_and_a_constructors_error_names_the_place():
    with expect("model.size", r"model.size is required by unit.config.test_targets.Strict and has no value: set "
                              r"model.size"):
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
    ("head", {"_target_": f"{HERE}.Loaders"}, r"model.head._target_='unit.config.test_targets.Loaders' is refused: .* "
                                              r"here "
                                              r"a torch.nn.modules.module.Module \(the annotation of the parameter"),
    ("loss", {"_target_": "torch.nn.MSELoss"}, None),
    ("loss", {"_target_": "torch.nn.Linear", "in_features": 1, "out_features": 1},
     r"here a torch.nn.modules.loss.MSELoss or a torch.nn.modules.loss.L1Loss"),
    ("layers", [{"_target_": "torch.nn.ReLU"}, {"_target_": "xtrainer.callbacks.EarlyStopping"}],
     r"model.layers\[1\]._target_='xtrainer.callbacks.EarlyStopping' is refused"),
    ("anything", {"_target_": "torch.nn.ReLU"}, r"model.anything._target_='torch.nn.ReLU' is refused: the parameter "
                                                r"'anything' of unit.config.test_targets.Tiny has no class annotation "
                                                r"\(it has "
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
