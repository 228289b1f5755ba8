"""The native strategies on the GPU: what ``./dev gpu-check`` runs on a CUDA machine before its
benchmark (``benchmarks/gpu_check.py``). Each test fits for real on ``accelerator="cuda"`` where
PyTorch sees a CUDA device and on ``accelerator="cpu"`` otherwise, so this file runs in CI on the
CPU too and cannot rot:

- ``native`` trains on the device (parameters, batches and optimizer state on it);
- ``native_fsdp`` at world size 1 trains as ``native`` does;
- ``torch.compile`` (``NativeSingle(compile=True)``) compiles and trains as eager does;
- ``bf16-mixed`` runs the step under bfloat16 autocast and keeps the weights in float32;
- a checkpoint round trip: the weights and AdamW's state written, read back, restored;
- a run stopped after a checkpoint and resumed from it ends with the final weights of an
  uninterrupted run, bitwise (dropout draws from the device's generator, the loader shuffles).

The module is a small MLP (no embedding: its CUDA backward adds with atomics, in no fixed order)
and AdamW, fused where the device has the fused kernels. Imports nothing of torch_xla.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from xtrainer import Trainer, XModule, seed_everything
from xtrainer.callbacks import Callback, ModelCheckpoint
from xtrainer.checkpoint import load_checkpoint
from xtrainer.strategies import NativeFSDP, NativeSingle

CUDA = torch.cuda.is_available()
ACCELERATOR = "cuda" if CUDA else "cpu"
FEATURES, CLASSES, WIDTH = 16, 4, 64
STEPS = 12  # two epochs of 6 batches: the resumed run crosses an epoch's end


@pytest.fixture(autouse=True)
def deterministic_kernels(monkeypatch):
    """cuBLAS's fixed workspace, as torch's reproducibility notes ask for bitwise runs."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def make_loader(shuffle: bool = True) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (48,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=shuffle)


class Net(XModule):
    """Linear, LayerNorm, GELU, dropout, linear; cross-entropy; AdamW (fused on CUDA)."""

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.LayerNorm(WIDTH), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(WIDTH, CLASSES))
        self.seen: dict[str, object] = {}

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        if not self.seen:  # shapes and types only: no host sync
            self.seen = {"batch": x.device.type, "parameters": self.net[0].weight.device.type,
                         "logits": logits.dtype, "weight": self.net[0].weight.dtype}
        loss = nn.functional.cross_entropy(logits.float(), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x).float(), y))

    def configure_optimizers(self):
        fused = {"fused": True} if CUDA else {}
        return torch.optim.AdamW(self.parameters(), lr=1e-2, **fused)


class OptimizerState(Callback):
    """The device of AdamW's state after the first step."""

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if not hasattr(self, "device"):
            state = trainer.optimizers[0].state[next(module.parameters())]
            self.device = state["exp_avg"].device.type


def fit(root, strategy="native", steps=STEPS, ckpt_path=None, model=None, precision="32", dropout=0.1,
        shuffle=True, callbacks=()) -> tuple[Trainer, Net]:
    seed_everything(0)
    model = model if model is not None else Net(dropout)
    trainer = Trainer(accelerator=ACCELERATOR, strategy=strategy, devices=1, max_steps=steps, precision=precision,
                      default_root_dir=str(root), compilation_cache=os.path.join(os.path.dirname(root), "compiled"),
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), log_every_n_steps=2,
                      callbacks=list(callbacks))
    trainer.fit(model, make_loader(shuffle), ckpt_path=ckpt_path)
    return trainer, model


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs: max {(a[key] - b[key]).abs().max().item()}"


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=tol, atol=tol, msg=f"{key} differs")


def test_native_trains_on_the_device(tmp_path):
    probe = OptimizerState()
    seed_everything(0)
    before = weights(Net())  # the initialisation fit's module gets (seeded alike)
    trainer, model = fit(tmp_path, callbacks=[probe])
    assert trainer.global_step == STEPS
    assert model.seen["batch"] == model.seen["parameters"] == probe.device == ACCELERATOR
    assert torch.isfinite(trainer.callback_metrics["train_loss"]).all()
    after = weights(model)
    assert all(not torch.equal(before[k], after[k]) for k in after), "a parameter did not train"
    if CUDA:  # the allocator's figures, as the runtime reports them
        assert trainer.strategy.runtime.memory_info()["bytes_used"] > 0


def test_native_fsdp_at_world_size_one_trains_as_native(tmp_path):
    _, plain = fit(tmp_path / "native", dropout=0.0)
    trainer, sharded = fit(tmp_path / "fsdp", strategy=NativeFSDP(), dropout=0.0)
    assert trainer.global_step == STEPS and trainer.world_size == 1
    assert sharded.seen["parameters"] == ACCELERATOR
    assert_close(weights(plain), weights(sharded), 1e-5)


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_compile_trains_as_eager_does(tmp_path, precision):
    _, eager = fit(tmp_path / "eager", precision=precision, dropout=0.0)
    trainer, compiled = fit(tmp_path / "compiled", strategy=NativeSingle(compile=True), precision=precision,
                            dropout=0.0)
    assert trainer.global_step == STEPS
    assert trainer.strategy.runtime.compile_count() >= 1  # torch.compile's graphs, counted by the runtime
    assert compiled.seen["parameters"] == ACCELERATOR
    # inductor fuses and reorders what eager computes one op at a time: close, not bitwise
    assert_close(weights(eager), weights(compiled), 1e-4 if precision == "32" else 5e-2)


def test_bf16_mixed_runs_under_autocast_and_keeps_float32_weights(tmp_path):
    trainer, model = fit(tmp_path, precision="bf16-mixed")
    assert model.seen["logits"] == torch.bfloat16 and model.seen["weight"] == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert torch.isfinite(trainer.callback_metrics["train_loss"]).all()


def _checkpointed(root, steps: int, **options) -> tuple[Trainer, Net, str]:
    """A fit of ``steps`` steps whose ``ModelCheckpoint`` writes the full training state at its
    last step, as a run stopped there leaves it; the checkpoint's path."""
    every = ModelCheckpoint(dirpath=str(root / "checkpoints"), every_n_train_steps=steps, save_top_k=-1, save_last=False)
    trainer, model = fit(root, steps=steps, callbacks=[every], **options)
    [path] = glob.glob(str(root / "checkpoints" / "*.ckpt"))
    return trainer, model, path


def test_checkpoint_round_trip(tmp_path):
    trainer, model, path = _checkpointed(tmp_path, STEPS // 2)
    saved = load_checkpoint(path)
    assert saved["global_step"] == STEPS // 2 and not saved.get("weights_only")
    assert_bitwise(saved["state_dict"], weights(model))
    [state] = saved["optimizer_states"]
    live = trainer.optimizers[0].state_dict()["state"]  # the fit ended at the checkpoint's step
    assert len(state["state"]) == len(live) == len(list(model.parameters()))
    for index, tensors in state["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(tensors[name].cpu(), live[index][name].cpu()), (index, name)
    # Read back into a fresh module: validate restores the weights onto the device.
    fresh = Net()
    validator = Trainer(accelerator=ACCELERATOR, strategy="native", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    validator.validate(fresh, make_loader(shuffle=False), ckpt_path=path, verbose=False)
    assert_bitwise(weights(fresh), weights(model))
    assert next(fresh.parameters()).device.type == ACCELERATOR


@pytest.mark.parametrize("config", ["native", "compile+bf16-mixed"])
def test_a_resumed_run_ends_bitwise_as_an_uninterrupted_one(tmp_path, config):
    """Stopped at a checkpoint mid-epoch, resumed in a new Trainer and module: the same final
    weights as the run that never stopped. ``compile+bf16-mixed`` is the benchmark's setting."""
    options = {"native": {}, "compile+bf16-mixed": {"precision": "bf16-mixed"}}[config]
    strategy = (lambda: NativeSingle(compile=True)) if "compile" in config else (lambda: "native")
    _, whole = fit(tmp_path / "whole", strategy=strategy(), **options)
    _, stopped, path = _checkpointed(tmp_path / "first", STEPS // 2 - 1, strategy=strategy(), **options)  # mid-epoch
    assert not any(torch.equal(a, b) for a, b in zip(weights(stopped).values(), weights(whole).values()))
    trainer, resumed = fit(tmp_path / "then", strategy=strategy(), ckpt_path=path, model=Net(), **options)
    assert trainer.global_step == STEPS
    assert_bitwise(weights(whole), weights(resumed))
