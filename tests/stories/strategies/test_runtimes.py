"""The device layer (``xtrainer/runtimes``): what ``accelerator="auto"`` and Lightning's strategy
names pick, the selection logic against a PrivateUse1 device registered without tensors (a
TorchTPU, TorchNeuron or other backend's stand-in), and the contracts that keep the device in the
runtime and strategy names inside ``strategies/``."""

import ast
import json
import os
import subprocess
import sys

import conftest
import pytest
import torch
from conftest import HAS_XLA, subprocess_timeout
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import xtrainer
from xtrainer import Trainer, XModule
from xtrainer.runtimes import NATIVE, XLA, EagerRuntime, XlaRuntime, select_family
from xtrainer.strategies import STRATEGIES
from xtrainer.strategies.base import Strategy
from xtrainer.strategies.native import NativeSingle

HERE = os.path.dirname(os.path.abspath(conftest.__file__))
ROOT = os.path.dirname(os.path.abspath(xtrainer.__file__))
QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


# ---- what "auto" picks on this machine (a CPU, torch_xla's CPU runtime installed) -------------------
@pytest.mark.parametrize("kwargs, strategy, runtime", [
    ({}, "native", "cpu"),
    ({"devices": 2}, "native_ddp", "cpu"),
    ({"strategy": "ddp", "devices": 2}, "native_ddp", "cpu"),
    ({"strategy": "fsdp", "devices": 2}, "native_fsdp", "cpu"),
    ({"accelerator": "cpu"}, "native", "cpu"),
    ({"strategy": "single_device"}, "native", "cpu"),
    ({"accelerator": "xla"}, "xla_native", "xla"),
    ({"accelerator": "xla", "strategy": "ddp", "devices": 2}, "xla_ddp", "xla"),
    ({"accelerator": "xla", "strategy": "fsdp", "devices": 2}, "xla_fsdp", "xla"),
    ({"strategy": "ddp_find_unused_parameters_true", "devices": 2}, "native_ddp", "cpu"),
    ({"strategy": "xla_native", "accelerator": "cpu"}, "xla_native", "xla"),
], ids=lambda v: str(v) if not isinstance(v, dict) else ",".join(f"{k}={x}" for k, x in v.items()) or "default")
def test_auto_runs_eagerly_on_the_cpu_and_torch_xla_is_an_explicit_choice(kwargs, strategy, runtime):
    """Lightning's ``accelerator="auto"`` on a machine with no accelerator: the CPU, eagerly; the
    XLA CPU runtime only when asked for (``accelerator="xla"`` or an ``xla_*`` strategy), and
    Lightning's ``"ddp"``/``"fsdp"`` name the chosen family's."""
    if runtime == "xla" and not HAS_XLA:
        pytest.skip("torch_xla is not installed in this environment")
    trainer = Trainer(**kwargs, **QUIET)
    assert (trainer.strategy.name, trainer.strategy.runtime.type) == (strategy, runtime)
    assert trainer.strategy.runtime.lazy == (runtime == "xla")
    if strategy == "native_ddp" and "unused" in str(kwargs):
        assert trainer.strategy.ddp_kwargs == {"find_unused_parameters": True}


def test_auto_under_torchrun_is_data_parallel_over_its_processes(monkeypatch):
    """A process that torchrun started as one of two: Lightning's "auto" is DDP there, never the
    one-device strategy (which would refuse torchrun's two processes)."""
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("XTRAINER_NATIVE_REPLICA", raising=False)
    trainer = Trainer(**QUIET)
    assert (trainer.strategy.name, trainer.strategy.devices) == ("native_ddp", 2)


def test_auto_picks_torch_xla_only_where_pjrt_has_a_real_accelerator(monkeypatch):
    """torch_xla installed: ``auto`` is XLA where ``PJRT_DEVICE`` names a real device (a TPU),
    and the CPU where it names the CPU runtime or, unset, no TPU chip is on the PCI bus (torch_xla's
    own scan; no runtime is started)."""
    if not HAS_XLA:
        monkeypatch.setenv("PJRT_DEVICE", "TPU")
        assert select_family("auto") == NATIVE and select_family("tpu") == NATIVE  # no torch_xla: never XLA
        return
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    assert select_family("auto") == XLA and select_family("tpu") == XLA
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert select_family("auto") == NATIVE
    monkeypatch.delenv("PJRT_DEVICE")
    assert select_family("auto") == NATIVE  # this machine has no TPU chip
    assert select_family("xla") == XLA and select_family("cpu") == NATIVE


# ---- the selection logic against a registered PrivateUse1 device ---------------------------------
@pytest.mark.parametrize("name, chips, backend, compile_defaults, device, index_asked", [
    ("tpu", 4, "tpu_dist", {"backend": "tpu", "dynamic": False}, "tpu:0", False),
    ("neuron", 2, "neuron", {"backend": "neuron", "fullgraph": True, "dynamic": False}, "neuron:1", True),
    ("npu", 2, "npuccl", {}, "npu:1", True),
])
def test_a_registered_backend_is_selected_through_torch_accelerator_alone(name, chips, backend, compile_defaults,
                                                                          device, index_asked):
    """A backend registered as PyTorch's accelerator (PrivateUse1 renamed, a device module whose
    device calls refuse callers outside PyTorch, as TorchTPU's do) is what ``auto`` picks, one
    device or data parallel over its chips, with its c10d backend from torch's map, its
    ``torch.compile`` defaults under the user's, and its device index by its convention: TorchTPU's
    processes each see their chip as index 0 (``current_device_index``), others take their local
    rank. A call to the forbidden device API would fail the run."""
    run = subprocess.run([sys.executable, os.path.join(HERE, "privateuse1_run.py"), name, str(chips)],
                         capture_output=True, text=True, timeout=subprocess_timeout(120))
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["family_auto"] and report["family_named"]
    assert (report["strategy"], report["devices"], report["type"]) == ("native_ddp", chips, name)
    assert (report["one_strategy"], report["one_type"]) == ("native", name)
    assert report["fsdp"] == "native_fsdp"
    assert report["backend"] == backend
    assert report["compile"] == compile_defaults
    assert report["compile_user"] == {**compile_defaults, "dynamic": True, "mode": "max-autotune"}
    assert report["device"] == device
    # the index: set through torch.accelerator; asked of torch.accelerator's device count only where
    # the backend numbers a host's devices by local rank
    assert report["start_calls"][-1] == ["set_device_index", int(device.split(":")[1])]
    assert ("device_count" in report["start_calls"]) == index_asked


# ---- Lightning projects that torch_xla's semantics broke, run as written ------------------------------
def _points(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


class _MetricsProject(XModule):
    """torchmetrics' functional accuracy in the validation step, as a Lightning tutorial writes it
    (it sums a 0-dim tensor over dim 0, which eager torch allows and torch_xla refuses)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        from torchmetrics.functional import accuracy

        x, y = batch
        self.log("val_acc", accuracy(self.net(x).argmax(-1), y, task="multiclass", num_classes=3))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class _AveragedProject(_MetricsProject):
    """A model averaged as it trains (``torch.optim.swa_utils.AveragedModel``), updated after
    every step (torch_xla's input-buffer donation deleted its buffers in the second epoch)."""

    def __init__(self):
        super().__init__()
        self.averaged = torch.optim.swa_utils.AveragedModel(self.net)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.averaged.update_parameters(self.net)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self.averaged(x).argmax(-1) == y).float().mean())


@pytest.mark.parametrize("project", [_MetricsProject, _AveragedProject], ids=["torchmetrics", "averaged_model"])
def test_lightning_projects_run_unchanged_with_accelerator_auto(project):
    pytest.importorskip("torchmetrics")
    torch.manual_seed(0)
    trainer = Trainer(accelerator="auto", max_epochs=3, **QUIET)
    model = project()
    trainer.fit(model, DataLoader(_points(), batch_size=16, shuffle=True), DataLoader(_points(48, 1), batch_size=16))
    assert trainer.strategy.runtime.type == "cpu" and trainer.global_step == 18
    assert 0.0 <= float(trainer.callback_metrics["val_acc"]) <= 1.0
    if project is _AveragedProject:
        assert int(model.averaged.n_averaged) == 18


# ---- contracts -------------------------------------------------------------------------------------------
def _sources(*skip: str):
    for folder, _, files in os.walk(ROOT):
        for file in files:
            path = os.path.join(folder, file)
            rel = os.path.relpath(path, ROOT)
            if file.endswith(".py") and not rel.startswith(skip):
                yield rel, ast.parse(open(path).read(), rel)


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


DEVICE_MODULES = ("torch.cuda", "torch.tpu", "torch.neuron", "torch.xpu", "torch.mps", "torch.get_device_module")


def _device_api_calls(tree: ast.AST) -> list[str]:
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = _dotted(node)
            if any(name == m or name.startswith(m + ".") for m in DEVICE_MODULES):
                hits.append(f"{name} (line {node.lineno})")
    return hits


def test_only_the_eager_runtime_calls_a_device_modules_api():
    """``torch.cuda.*``, ``torch.tpu.*``, ``torch.get_device_module(...)``: only
    ``runtimes/eager.py``; everything else asks the runtime (TorchTPU refuses its device module's
    calls from outside PyTorch)."""
    offenders = {rel: hits for rel, tree in _sources("runtimes/eager.py") if (hits := _device_api_calls(tree))}
    assert not offenders, f"call the runtime (strategy.runtime), not the device module: {offenders}"
    eager = ast.parse(open(os.path.join(ROOT, "runtimes", "eager.py")).read())
    assert _device_api_calls(eager)  # the check sees a call where there is one


def _name_checks(tree: ast.AST) -> list[str]:
    names = set(STRATEGIES)

    def named(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(named(e) for e in node.elts)
        return False

    return [f"line {node.lineno}" for node in ast.walk(tree)
            if isinstance(node, ast.Compare) and any(named(c) for c in [node.left, *node.comparators])]


def test_no_strategy_name_is_checked_outside_strategies():
    """Code outside ``strategies/`` asks a strategy's capabilities (``shards_parameters``,
    ``flattens_parameters``, ``reduces_wrapped_trainable_only``...), never compares its name."""
    offenders = {rel: hits for rel, tree in _sources("strategies") if (hits := _name_checks(tree))}
    assert not offenders, f"ask the strategy a capability, not its name: {offenders}"
    assert _name_checks(ast.parse("if trainer.strategy.name in ('xla_fsdp',): pass"))  # the check sees one


def test_the_strategy_leaves_the_device_to_its_runtime():
    """``Strategy`` has no device members (the runtime's), and the native family's base states
    only its difference."""
    from xtrainer.strategies.lightning_api import LightningCollectives

    lightnings = {name for name in dir(LightningCollectives) if not name.startswith("_")}  # one call of collectives each
    assert lightnings == {"root_device", "barrier", "broadcast", "reduce", "all_gather", "reduce_boolean_decision"}
    public = [name for name in dir(Strategy) if not name.startswith("_") and name not in lightnings]
    device_members = {"sync", "to_cpu", "rng_state", "set_rng_state", "rng_state_kept", "add_step_closure",
                      "device_counters", "compile_count", "memory_info", "batches_on_device", "lazy"}
    assert not device_members & set(public)
    # 30 after the runtime split; since then the distribution gained Lightning's tensor_init_context
    # (model_parallel's meta-device init), requires_grad_changed (fine-tuning under sharding), and
    # native_ft's live peers (step_starts, join_live_peers), runs_standalone (the doctor) and
    # parameters_in_layers (fine-tuning under xla_fsdp, whose layers hold no parameters while wrapped)
    assert len(public) <= 35, public
    own = {name for name in vars(NativeSingle) if name in dir(Strategy)
           and name not in ("__doc__", "__module__", "__init__", "__annotations__", "__abstractmethods__", "_abc_impl", "name")}
    assert len(own) <= 8, sorted(own)
    assert isinstance(STRATEGIES["native"]().runtime, EagerRuntime)
    assert isinstance(STRATEGIES["xla_native"]().runtime, XlaRuntime)


def test_the_runtime_names_its_chip_for_mfu(monkeypatch):
    """MFU needs the chip's peak: a CUDA device by its name, a TPU by its accelerator type (XLA's
    or TorchTPU's), ``XTRAINER_CHIP`` over both; nothing on the CPU."""
    from xtrainer import flops

    assert flops.gpu_chip("NVIDIA H200") == "h200" and flops.gpu_chip("NVIDIA H100 80GB HBM3") == "h100"
    assert flops.gpu_chip("Tesla T4") is None and flops.tpu_chip("v5litepod-8") == "tpu-v5e"
    assert flops.peak_flops(flops.gpu_chip("NVIDIA H200")) == 989e12
    monkeypatch.delenv("XTRAINER_CHIP", raising=False)
    assert EagerRuntime("cpu").chip_name() is None
    monkeypatch.setenv("XTRAINER_CHIP", "h100")
    assert EagerRuntime("cpu").chip_name() == "h100" and XlaRuntime().chip_name() == "h100"
