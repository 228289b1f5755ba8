"""Hugging Face models under xtrainer: a tiny Llama from a config (no download) trains under FSDP
with its decoder layers auto-wrapped by name or from ``_no_split_modules``; the YAML example runs
through the CLI; the auto-wrap spellings are refused clearly when wrong; ``prefer_foreach``."""

import os
import re
import subprocess
import sys

import conftest
import pytest
import torch
from conftest import Regressor, make_loader, subprocess_timeout
from torch import nn

from xtrainer import Trainer, _xla
from xtrainer.callbacks import Callback
from xtrainer.config import ConfigError, build, load
from xtrainer.loop.optimizers import prefer_foreach
from xtrainer.strategies import XlaFSDP, XlaFSDPv2
from xtrainer.strategies.wrap_policies import layer_classes, no_split_classes, wrap_policy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(conftest.__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "tiny_llama.yaml")
if ROOT not in sys.path:  # the example's module: examples.tiny_llama
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="module")
def hf():
    return pytest.importorskip("transformers")


def tiny_llama_module(**kwargs):
    from examples.tiny_llama import TinyLlama

    torch.manual_seed(0)
    return TinyLlama(**{"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
                        "max_position_embeddings": 16, "lr": 1e-2, **kwargs})


def text_loader(batch_size=8):
    from examples.tiny_llama import TextData

    return TextData(seq_len=16, stride=16, batch_size=batch_size, repeat=1).train_dataloader()


class Units(Callback):
    """The FSDP units around the module, what each wraps, whether it recomputes its activations,
    and the training losses."""

    def __init__(self):
        self.units, self.losses = [], []

    def on_train_start(self, trainer, module):
        fsdp = _xla.fsdpv2_class() if trainer.strategy.name == "xla_fsdpv2" else _xla.fsdp_wrapper_class()
        for unit in trainer.model.modules():
            if isinstance(unit, fsdp):
                inner = unit.module if trainer.strategy.name == "xla_fsdpv2" else trainer.strategy.unwrap(unit)
                self.units.append((type(inner).__name__, hasattr(inner, "_xla_checkpointed_forward_original")))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(trainer.callback_metrics["train_loss"])

    def state_dict(self):
        return {"units": self.units, "losses": self.losses}

    def load_state_dict(self, state):
        self.units, self.losses = state["units"], state["losses"]


def fit(tmp_path, strategy, devices=1, steps=8):
    units = Units()
    trainer = Trainer(strategy=strategy, devices=devices, max_steps=steps, log_every_n_steps=1, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                      num_sanity_val_steps=0, default_root_dir=str(tmp_path), callbacks=[units])
    model = tiny_llama_module()
    trainer.fit(model, text_loader())
    return trainer, model, units


# ---- auto-wrap: spellings, resolution, refusals (no training) -------------------------------------
def test_wrap_policy_resolves_class_names_against_the_models_own_layers(hf):
    model = tiny_llama_module().model
    decoder = type(model.model.layers[0])
    assert no_split_classes(model) == {decoder}
    assert layer_classes(model, ["LlamaDecoderLayer"]) == {decoder}
    assert layer_classes(model, [f"{decoder.__module__}.LlamaDecoderLayer"]) == {decoder}  # qualified
    for spelling in ("no_split_modules", "LlamaDecoderLayer", ["LlamaDecoderLayer"], {decoder},
                     {"transformer_layer_cls": ["LlamaDecoderLayer"]}, {"transformer_layer_cls": "no_split_modules"}):
        assert wrap_policy(spelling, model).keywords == {"transformer_layer_cls": {decoder}}, spelling
    assert wrap_policy({"min_num_params": 1000}, model).keywords == {"min_num_params": 1000}


def test_wrap_policy_attacks_are_refused_clearly_and_import_nothing(hf):
    model = tiny_llama_module().model
    with pytest.raises(ValueError, match="no submodule of LlamaForCausalLM is of a class by that name.*"
                                         "Did you mean 'LlamaDecoderLayer'.*Layer classes in the model: "):
        wrap_policy({"transformer_layer_cls": ["LlamaDecoderLayr"]}, model)
    # a string naming an importable, dangerous callable is matched against the model's classes only
    assert "antigravity" not in sys.modules  # importing it would open a web browser
    for dangerous in ("os.system", "subprocess.Popen", "antigravity.geohash", "builtins.eval"):
        with pytest.raises(ValueError, match=f"names '{dangerous}', but no submodule .* nothing is imported"):
            wrap_policy([dangerous], model)
    assert "antigravity" not in sys.modules
    with pytest.raises(ValueError, match="is not a class name .* nothing is imported"):
        wrap_policy(["__import__('os').system('echo pwned')"], model)
    # _no_split_modules missing (a plain torch module), or naming no class the model has
    with pytest.raises(ValueError, match="no submodule of Sequential has a _no_split_modules.*transformer_layer_cls"):
        wrap_policy("no_split_modules", nn.Sequential(nn.Linear(2, 2)))
    odd = nn.Sequential(nn.Linear(2, 2))
    odd._no_split_modules = ["Block"]
    with pytest.raises(ValueError, match=r"_no_split_modules names \['Block'\], but no submodule is of those"):
        wrap_policy("no_split_modules", odd)
    # two classes of one name: the qualified name decides
    twin = type("LlamaMLP", (nn.Module,), {"forward": lambda self, x: x})
    model.extra = twin()
    with pytest.raises(ValueError, match="several classes of that name.*qualified name"):
        layer_classes(model, ["LlamaMLP"])
    assert layer_classes(model, [f"{twin.__module__}.LlamaMLP"]) == {twin}


@pytest.mark.parametrize("policy, message", [
    ({"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}, "Did you mean 'transformer_layer_cls'"),
    ({"transformer_layer_cls": []}, "names no layer class"),
    (True, "give a parameter count"),
    (0, "at least 1"),
    ([3], "neither a layer class nor a class name"),
    ({"min_num_params": "many"}, "min_num_params is a parameter count"),
    ("no_split_module", "Did you mean 'no_split_modules'"),
])
def test_malformed_policies_are_refused_when_the_strategy_is_made(policy, message):
    for strategy in (XlaFSDP, XlaFSDPv2):
        with pytest.raises((ValueError, TypeError), match=message):
            strategy(auto_wrap_policy=policy)


def test_the_config_refuses_a_malformed_policy_before_anything_trains(hf):
    config = load(["--config", EXAMPLE, "trainer.strategy.auto_wrap_policy={layer_cls: [LlamaDecoderLayer]}"])
    with pytest.raises(ConfigError, match="trainer.strategy: auto_wrap_policy=.*a mapping has one key"):
        build(config, "fit")


# ---- training ------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", [{"transformer_layer_cls": ["LlamaDecoderLayer"]}, "no_split_modules"])
def test_xla_fsdp_wraps_exactly_the_decoder_layers_each_checkpointed(hf, policy):
    strategy = XlaFSDP(auto_wrap_policy=policy, activation_checkpointing=True)
    model = tiny_llama_module().model.to(_xla.device())
    root = strategy._fsdp_class()(model, **strategy._wrap_kwargs(model))  # as setup_module wraps the root
    units = [strategy.unwrap(unit) for unit in root.modules() if isinstance(unit, strategy._fsdp_class())]
    assert [type(unit).__name__ for unit in units] == ["LlamaForCausalLM", "LlamaDecoderLayer", "LlamaDecoderLayer"]
    assert [hasattr(unit, "_xla_checkpointed_forward_original") for unit in units] == [False, True, True]


@pytest.mark.slow
def test_tiny_llama_trains_under_xla_fsdpv2_from_no_split_modules(tmp_path, hf):
    strategy = XlaFSDPv2(auto_wrap_policy="no_split_modules", activation_checkpointing=True)
    trainer, model, units = fit(tmp_path, strategy, devices=4)
    assert sorted(units.units) == [("LlamaDecoderLayer", True), ("LlamaDecoderLayer", True),
                                   ("StepDispatcher", False)]
    assert len(units.losses) == 8 and units.losses[-1] < 0.8 * units.losses[0]
    # given back whole: Hugging Face's own format saves and loads the trained weights
    model.model.save_pretrained(tmp_path / "pretrained")
    again = hf.AutoModelForCausalLM.from_pretrained(tmp_path / "pretrained")
    assert again.state_dict().keys() == model.model.state_dict().keys()
    for name, tensor in model.model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


@pytest.mark.slow
def test_the_yaml_example_trains_through_the_cli_under_xla_fsdp_on_two_replicas(tmp_path, hf):
    exe = os.path.join(os.path.dirname(sys.executable), "xtrainer")
    done = subprocess.run(
        [exe, "fit", "--config", EXAMPLE, "trainer.strategy.name=xla_fsdp", "trainer.devices=2",
         "trainer.strategy.auto_wrap_policy=no_split_modules", "model.hidden_size=64", "model.intermediate_size=128",
         "trainer.max_steps=20", "trainer.max_epochs=null", "trainer.val_check_interval=20", "trainer.num_sanity_val_steps=0", "trainer.enable_progress_bar=false", "trainer.logger=false",
         f"trainer.default_root_dir={tmp_path}"],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PJRT_DEVICE": "CPU"}, timeout=subprocess_timeout(600))
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = dict(re.findall(r"^  (\w+): (\S+)$", done.stdout, re.MULTILINE))  # the final metrics, printed
    # byte-level text starts at ln(256) = 5.55 nats per token; 20 steps learn the Zen's bytes
    assert float(metrics["val_loss"]) < 4.0 and float(metrics["train_loss"]) < 4.0, done.stdout


# ---- the foreach optimizer path ------------------------------------------------------------------
def test_prefer_foreach_turns_it_on_only_where_the_user_left_it_unset():
    device = _xla.device()
    on_xla = [nn.Parameter(torch.zeros(2, device=device)) for _ in range(3)]
    adam = torch.optim.AdamW([{"params": on_xla[:1]}, {"params": on_xla[1:2], "foreach": False},
                              {"params": on_xla[2:]}], lr=0.1)
    assert prefer_foreach(adam) == 2
    assert [group["foreach"] for group in adam.param_groups] == [True, False, True]
    assert prefer_foreach(adam) == 0  # already chosen
    assert prefer_foreach(torch.optim.AdamW([nn.Parameter(torch.zeros(2))])) == 0  # CPU tensors: torch decides
    assert prefer_foreach(torch.optim.Adam(on_xla, differentiable=True)) == 0  # foreach does not combine
    assert prefer_foreach(torch.optim.SGD(on_xla, lr=0.1, fused=False)) == 1
    assert prefer_foreach(torch.optim.LBFGS(on_xla)) == 0  # an optimizer without a foreach option


def test_prefer_foreach_steps_exactly_as_the_per_tensor_path():
    results = []
    for foreach in (False, True):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(_xla.device())
        opt = torch.optim.AdamW(net.parameters(), lr=0.05)
        if foreach:
            assert prefer_foreach(opt) == 1
        for x, y in make_loader():
            opt.zero_grad()
            nn.functional.mse_loss(net(x.to(_xla.device())), y.to(_xla.device())).backward()
            opt.step()
            _xla.sync()
        results.append([p.cpu() for p in net.parameters()])
    for per_tensor, multi in zip(*results):
        assert torch.equal(per_tensor, multi)


class AdamRegressor(Regressor):
    def __init__(self, foreach=None) -> None:
        super().__init__()
        self.foreach = foreach

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, foreach=self.foreach)


def test_the_trainer_turns_foreach_on_unless_the_user_chose_and_a_resume_keeps_the_choice(tmp_path):
    quiet = dict(strategy="xla_native", enable_progress_bar=False, num_sanity_val_steps=0, logger=False)  # XLA's foreach
    default = Trainer(max_epochs=1, default_root_dir=str(tmp_path / "a"), **quiet)
    default.fit(AdamRegressor(), make_loader())
    assert [group["foreach"] for group in default.optimizers[0].param_groups] == [True]
    opted_out = Trainer(max_epochs=1, enable_checkpointing=False, default_root_dir=str(tmp_path / "b"), **quiet)
    opted_out.fit(AdamRegressor(foreach=False), make_loader())
    assert [group["foreach"] for group in opted_out.optimizers[0].param_groups] == [False]
    # resumed from the checkpoint of the run that stepped with foreach: the opt-out still holds
    resumed = Trainer(max_epochs=2, enable_checkpointing=False, default_root_dir=str(tmp_path / "c"), **quiet)
    resumed.fit(AdamRegressor(foreach=False), make_loader(), ckpt_path=default.checkpoint_callback.last_model_path)
    assert resumed.global_step == 2 * len(make_loader())
    assert [group["foreach"] for group in resumed.optimizers[0].param_groups] == [False]
