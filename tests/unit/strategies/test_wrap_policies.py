"""FSDP auto-wrap policies (``xtrainer.strategies.wrap_policies``) on their own: every accepted
form and what it resolves to, every refused form with its message. No strategy is set up and
nothing trains; the torch_xla policies are built but not applied (the story tests apply them:
tests/stories/strategies/test_strategies.py, tests/stories/strategies/test_spmd.py,
tests/stories/strategies/test_hf.py)."""

import pytest
from torch import nn

from xtrainer.strategies.wrap_policies import (NO_SPLIT_MODULES, check_wrap_policy, layer_classes,
                                               no_split_classes, policy_kind, policy_layer_classes, wrap_policy)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        return self.inner(x)


class Head(nn.Module):
    def forward(self, x):
        return x


class Model(nn.Module):
    _no_split_modules = ["Block", "NotBuiltHere"]  # as a Hugging Face model names its decoder layers

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = Head()


def my_policy(module, recurse, unwrapped_params):
    return False


QUALIFIED = f"{Block.__module__}.Block"


@pytest.mark.parametrize("policy, kind", [
    (None, "none"),
    (100, "size"),
    ({"min_num_params": 100}, "size"),
    (Block, "classes"),
    ({Block}, "classes"),
    ([Block, "Head"], "classes"),
    (("Block",), "classes"),
    (frozenset({"Block"}), "classes"),
    ("Block", "classes"),
    (QUALIFIED, "classes"),
    ({"transformer_layer_cls": ["Block"]}, "classes"),
    ({"transformer_layer_cls": "Block"}, "classes"),
    ({"transformer_layer_cls": {Block}}, "classes"),
    (NO_SPLIT_MODULES, "no_split"),
    ({"transformer_layer_cls": NO_SPLIT_MODULES}, "no_split"),
    (my_policy, "callable"),
])
def test_every_accepted_form_and_its_kind(policy, kind):
    check_wrap_policy(policy)
    assert policy_kind(policy) == kind


@pytest.mark.parametrize("policy", [Block, {Block}, ["Block"], "Block", QUALIFIED,
                                    {"transformer_layer_cls": ["Block"]}, NO_SPLIT_MODULES])
def test_layer_forms_resolve_to_the_models_classes(policy):
    assert policy_layer_classes(policy, Model()) == {Block}


def test_size_and_callable_forms_name_no_layer_class():
    for policy in (None, 100, {"min_num_params": 5}, my_policy):
        assert policy_layer_classes(policy, Model()) == set()
    assert policy_layer_classes(["Block", "Head"], Model()) == {Block, Head}


def test_wrap_policy_builds_torch_xlas_policies():
    assert wrap_policy(None, Model()) is None
    assert wrap_policy(my_policy, Model()) is my_policy
    size = wrap_policy({"min_num_params": 100}, Model())
    assert size.func.__name__ == "size_based_auto_wrap_policy" and size.keywords == {"min_num_params": 100}
    layers = wrap_policy(NO_SPLIT_MODULES, Model())
    assert layers.func.__name__ == "transformer_auto_wrap_policy"
    assert layers.keywords == {"transformer_layer_cls": {Block}}
    # the policy answers for real modules: a Block is a unit of its own, the head is not
    assert layers(Block(), False, 20) and not layers(Head(), False, 0)
    assert size(Block(), False, 100) and not size(Block(), False, 99)
    # classes given in Python need no module; names do
    assert wrap_policy({Block}).keywords == {"transformer_layer_cls": {Block}}
    with pytest.raises(ValueError, match="auto_wrap_policy by class name needs the module"):
        wrap_policy(["Block"])


FORMS = "give a parameter count"


@pytest.mark.parametrize("policy, error, message", [
    (True, TypeError, rf"auto_wrap_policy=True: {FORMS} \(int\), layer classes"),
    (1.5, TypeError, rf"auto_wrap_policy=1.5: {FORMS}"),
    (0, ValueError, r"auto_wrap_policy=0: a parameter count is at least 1\."),
    (-3, ValueError, r"at least 1"),
    ({"min_num_params": 0}, ValueError, r"at least 1"),
    ({"min_num_params": "many"}, TypeError, r"min_num_params is a parameter count \(int\)"),
    ({"min_num_params": True}, TypeError, r"min_num_params is a parameter count"),
    ({"transformer_layer_cls_to_wrap": ["Block"]}, ValueError,
     r"a mapping has one key, 'transformer_layer_cls' or 'min_num_params'\. Did you mean 'transformer_layer_cls'"),
    ({"transformer_layer_cls": ["Block"], "min_num_params": 3}, ValueError, r"a mapping has one key"),
    ({}, ValueError, r"a mapping has one key"),
    ([], ValueError, r"auto_wrap_policy=\[\] names no layer class"),
    ({"transformer_layer_cls": []}, ValueError, r"names no layer class"),
    ([3], TypeError, r"3 is neither a layer class nor a class name"),
    ([int], TypeError, r"names <class 'int'>, which is not an nn.Module class"),
    (str, TypeError, r"which is not an nn.Module class"),
    (["os.system('x')"], ValueError, r"is not a class name \(such as LlamaDecoderLayer\).*nothing is imported"),
    ("no_split_module", ValueError, r"'no_split_module' is neither a layer class's name nor 'no_split_modules'\. "
                                    r"Did you mean 'no_split_modules'"),
    (object(), TypeError, rf"auto_wrap_policy=<object object at .*>: {FORMS}"),
])
def test_every_refused_form_and_its_message(policy, error, message):
    with pytest.raises(error, match=message) as info:
        check_wrap_policy(policy)
    assert "\n" not in str(info.value)


def test_names_are_matched_against_the_models_own_classes_only():
    model = Model()
    with pytest.raises(ValueError, match=r"names 'Blok', but no submodule of Model is of a class by that name .*"
                                         r"nothing is imported\)\. Did you mean 'Block'.*Layer classes in the model: "
                                         r"Block, Head, Model"):
        layer_classes(model, ["Blok"])
    with pytest.raises(ValueError, match="names 'torch.nn.Linear'"):  # importable, but named by its own name only
        layer_classes(model, ["torch.nn.Linear"])
    assert layer_classes(model, ["Linear"]) == {nn.Linear}  # torch's own layers, by the name the model holds
    assert layer_classes(model, [nn.Conv2d]) == {nn.Conv2d}  # a class given in Python: wrapped where it occurs


def test_two_classes_of_one_name_need_the_qualified_name():
    model = Model()
    model.other = type("Block", (nn.Module,), {"__module__": "elsewhere", "forward": lambda self, x: x})()
    with pytest.raises(ValueError, match=r"Model has several classes of that name: \['elsewhere.Block', .*"
                                         r"Give the qualified name"):
        layer_classes(model, ["Block"])
    assert layer_classes(model, ["elsewhere.Block"]) == {type(model.other)}
    assert layer_classes(model, [QUALIFIED]) == {Block}


def test_no_split_modules_skips_absent_names_and_refuses_when_nothing_is_left():
    assert no_split_classes(Model()) == {Block}  # "NotBuiltHere" is not in this configuration of the model
    with pytest.raises(ValueError, match=r"no submodule of Sequential has a _no_split_modules \(or it is empty\)\. "
                                         r"Name the layer classes instead"):
        no_split_classes(nn.Sequential(nn.Linear(2, 2)))
    odd = nn.Sequential(nn.Linear(2, 2))
    odd._no_split_modules = "Missing"
    with pytest.raises(ValueError, match=r"Sequential's _no_split_modules names \['Missing'\], but no submodule is "
                                         r"of those classes"):
        no_split_classes(odd)


def test_the_step_dispatchers_inner_module_names_the_model_in_messages():
    class Dispatcher(nn.Module):  # what the Trainer wraps the user's module in
        def __init__(self, module):
            super().__init__()
            self.module = module

    with pytest.raises(ValueError, match="no submodule of Model is of a class"):
        layer_classes(Dispatcher(Model()), ["Nothing"])
