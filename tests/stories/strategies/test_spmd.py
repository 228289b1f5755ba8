"""SPMD strategies on 4 virtual CPU devices: one program partitioned by sharding annotations."""

import glob
import os
import subprocess
import sys

import conftest
import pytest
import torch
from conftest import Regressor, make_loader

from xtrainer import Trainer, _xla
from xtrainer.callbacks import Callback, ModelCheckpoint, XlaHealth
from xtrainer.checkpoint import CheckpointError, UnreadableCheckpointError, consolidate, load_checkpoint
from xtrainer.strategies import STRATEGIES, XlaFSDPv2, XlaSPMD

SPMD_STRATEGIES = [name for name, cls in STRATEGIES.items() if issubclass(cls, XlaSPMD)]  # from the registry

pytestmark = pytest.mark.multi_device


class Steps(Callback):
    """Every step's loss, and the sharding of the first layer's weight, as the replica saw them."""

    def __init__(self):
        self.losses, self.sharding = [], None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train_loss_step"]))
        self.sharding = _xla.sharding_of(module.net[0].weight)

    def state_dict(self):
        return {"losses": self.losses, "sharding": self.sharding}

    def load_state_dict(self, state):
        self.losses, self.sharding = state["losses"], state["sharding"]


def fit(tmp_path, strategy, devices=4, epochs=2, ckpt_path=None, callbacks=()):
    steps = Steps()
    model = Regressor(optimizer="adam", lr=0.02)
    trainer = Trainer(strategy=strategy, devices=devices, max_epochs=epochs, log_every_n_steps=1,
                      default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False,
                      callbacks=[steps, XlaHealth(on_recompile="raise"), *callbacks])
    trainer.fit(model, make_loader(shuffle=True), make_loader(n=16, seed=1), ckpt_path=ckpt_path)
    return trainer, model, steps


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    return fit(tmp_path_factory.mktemp("native"), "xla_native", devices=1)


@pytest.mark.parametrize("strategy", SPMD_STRATEGIES)
def test_spmd_follows_native_on_the_same_global_batches(tmp_path, native, strategy):
    trainer, model, steps = fit(tmp_path, strategy)  # XlaHealth(on_recompile="raise"): no recompilation
    _, ref_model, ref_steps = native
    assert len(steps.losses) == 16
    assert steps.losses == pytest.approx(ref_steps.losses, rel=1e-4, abs=1e-6)
    assert float(trainer.callback_metrics["val_loss"]) == pytest.approx(float(native[0].callback_metrics["val_loss"]), rel=1e-4)
    for name, tensor in ref_model.state_dict().items():
        assert torch.allclose(model.state_dict()[name], tensor, atol=1e-5), name
    # data parallel replicates the weights; FSDPv2 splits them over the 4 devices
    assert steps.sharding == ("{replicated}" if strategy == "xla_spmd" else "{devices=[4,1]0,1,2,3}")


class SaveCompilations(Callback):
    """The graphs the fit's checkpoint saves compiled, as the SPMD process counted them."""

    def __init__(self):
        self.count = None  # until the fit ends

    def on_train_end(self, trainer, module):
        self.count = trainer.checkpoint_compilations

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def test_fsdpv2_saves_shards_and_resumes_exactly_on_any_mesh(tmp_path):
    _, straight, _ = fit(tmp_path / "straight", XlaFSDPv2(), epochs=3)
    saver, compilations = ModelCheckpoint(save_top_k=-1), SaveCompilations()
    _, first_model, _ = fit(tmp_path / "run", XlaFSDPv2(), epochs=1, callbacks=[saver, compilations])
    path = os.path.realpath(os.path.join(saver.dirpath, "last.ckpt"))
    # a folder of torch.distributed.checkpoint shards and the trainer state; nothing was gathered
    assert sorted(os.listdir(path)) == ["manifest.json", "state", "trainer.pt"]
    assert sorted(os.listdir(os.path.join(path, "state"))) == [".metadata", "__0_0.distcp"]
    assert "state_dict" not in torch.load(os.path.join(path, "trainer.pt"), weights_only=True)
    assert compilations.count == 0
    # xtrainer consolidate gives the weights the run ended with
    out = tmp_path / "full.pt"
    cli = os.path.join(os.path.dirname(sys.executable), "xtrainer")
    done = subprocess.run([cli, "consolidate", path, "-o", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    full = torch.load(out, weights_only=True)
    assert full.keys() == first_model.state_dict().keys() == consolidate(path).keys()
    for name, tensor in full.items():
        assert torch.equal(tensor, first_model.state_dict()[name]), name

    # the shards are read into another mesh: 2 devices instead of 4 (the same mesh resumes in the
    # kill-and-resume matrix of tests/stories/checkpoints/test_checkpoint.py)
    resumed_trainer, on_two, steps = fit(tmp_path / "two", XlaFSDPv2(), devices=2, epochs=3, ckpt_path=path)
    assert resumed_trainer.global_step == 24 and steps.sharding == "{devices=[2,1]0,1}"
    for name, tensor in straight.state_dict().items():
        assert torch.allclose(on_two.state_dict()[name], tensor, atol=1e-5), name
    native_again, from_fsdpv2, _ = fit(tmp_path / "native", "xla_native", devices=1, epochs=3, ckpt_path=path)
    assert native_again.global_step == 24  # another strategy reads the folder whole
    for name, tensor in straight.state_dict().items():
        assert torch.allclose(from_fsdpv2.state_dict()[name], tensor, atol=1e-5), name


def test_fsdpv2_resumes_a_whole_checkpoint_of_another_strategy(tmp_path, native):
    saver = ModelCheckpoint()
    fit(tmp_path, "xla_native", devices=1, epochs=1, callbacks=[saver])
    # the optimizer state arrives whole and is sharded like its parameters: no recompilation
    trainer, model, steps = fit(tmp_path, XlaFSDPv2(), epochs=2, ckpt_path="last")
    assert trainer.global_step == 16 and steps.sharding == "{devices=[4,1]0,1,2,3}"
    for name, tensor in native[1].state_dict().items():
        assert torch.allclose(model.state_dict()[name], tensor, atol=1e-5), name


def test_broken_distributed_checkpoints_are_named(tmp_path, capfd):
    saver = ModelCheckpoint(save_top_k=-1)
    fit(tmp_path, XlaFSDPv2(), epochs=2, callbacks=[saver])
    older, newest = sorted(glob.glob(os.path.join(saver.dirpath, "epoch=*")))
    shard = os.path.join(newest, "state", "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(UnreadableCheckpointError, match="__0_0.distcp' has .* bytes, but its manifest says"):
        load_checkpoint(newest)
    with pytest.raises(CheckpointError, match="written by xla_fsdpv2 .*xla_fsdp at world size 1 cannot resume it.*"
                       "xtrainer consolidate"):
        Trainer(strategy="xla_fsdp", logger=False, enable_progress_bar=False,
                default_root_dir=str(tmp_path / "fsdp")).fit(Regressor(), make_loader(), ckpt_path=older)
    # "last" falls back to the newest checkpoint that verifies, and says which it skipped and why
    with pytest.warns(UserWarning, match=f"resuming from {older}.*skipped:\n  {newest}: .*__0_0.distcp' has"):
        trainer, _, _ = fit(tmp_path, XlaFSDPv2(), epochs=3, ckpt_path="last")
    assert trainer.global_step == 24
    # another model's checkpoint is refused before any step, saying what does not fit
    wider = Trainer(strategy=XlaFSDPv2(), devices=4, max_epochs=3, logger=False, enable_progress_bar=False,
                    default_root_dir=str(tmp_path / "wider"))
    with pytest.raises(CheckpointError, match=r"shape mismatches \(3\): net.0.weight \(16, 8\) \(module: \(32, 8\)\)"):
        wider.fit(WiderRegressor(), make_loader(), ckpt_path=older)


class WiderRegressor(Regressor):
    def __init__(self):
        super().__init__(optimizer="adam")
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


class Units(Callback):
    """How many FSDPv2 units wrap the module, and how many of them recompute activations."""

    def on_train_start(self, trainer, module):
        units = [m for m in trainer.model.modules() if isinstance(m, _xla.fsdpv2_class())]
        self.counts = {"units": len(units),
                       "checkpointed": sum(hasattr(m.module, "_xla_checkpointed_forward_original") for m in units)}

    def state_dict(self):
        return self.counts

    def load_state_dict(self, state):
        self.counts = state


def test_fsdpv2_auto_wraps_layers_with_activation_checkpointing(tmp_path, native):
    def strategy():
        return XlaFSDPv2(auto_wrap_policy={torch.nn.Linear}, activation_checkpointing=True)

    units = Units()
    _, _, steps = fit(tmp_path, strategy(), epochs=1, callbacks=[units, ModelCheckpoint()])
    assert units.counts == {"units": 3, "checkpointed": 2}  # the root, and each Linear checkpointed
    assert steps.losses == pytest.approx(native[2].losses[:8], rel=1e-4, abs=1e-6)
    # checkpoints name the weights as the bare module does, and resume into the wrapped units
    trainer, model, _ = fit(tmp_path, strategy(), epochs=2, ckpt_path="last")
    assert trainer.global_step == 16
    assert isinstance(model.net[0].weight, torch.nn.Parameter)  # given back unwrapped
    for name, tensor in native[1].state_dict().items():
        assert torch.allclose(model.state_dict()[name], tensor, atol=1e-5), name


def test_mesh_and_sharding_options_are_checked():
    with pytest.raises(ValueError, match="data_axis='batch'\\) is not one of the mesh's axes"):
        XlaSPMD(axis_names=("data",), data_axis="batch")
    with pytest.raises(ValueError, match="same length"):
        XlaSPMD(mesh_shape=(2, 2), axis_names=("data",))
    with pytest.raises(ValueError, match="activation_checkpointing=True .* auto_wrap_policy"):
        XlaFSDPv2(activation_checkpointing=True)


def test_tensor_parallel_shardings_on_a_second_axis(tmp_path):
    strategy = XlaFSDPv2(mesh_shape=(2, 2), axis_names=("fsdp", "model"), shardings={"net.0.weight": ("model", None)})
    _, model, steps = fit(tmp_path, strategy, epochs=1)
    assert steps.sharding.startswith("{devices=[2,1,2]")  # split over "model", replicated over "fsdp"
    assert model.net[0].weight.device.type == "cpu"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["xla_fsdpv2"])  # xla_spmd gives the same losses (test_strategies)
def test_digits_reaches_95_percent(tmp_path, strategy):
    sys.path.insert(0, os.path.join(os.path.dirname(conftest.__file__), ".."))
    from examples import digits

    metrics = digits.main([f"trainer.default_root_dir={tmp_path}", "trainer.enable_progress_bar=false",
                           f"trainer.strategy={strategy}", "trainer.devices=4"])
    assert metrics["val_acc"] >= 0.95
