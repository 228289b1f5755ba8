"""Several replicas on the CPU runtime (threads of one process started by ``Trainer.fit``).

Every replica writes down what it saw and holds (a callback), and the results are compared with
each other and with one replica trained on the same global batches: replica batch B x N replicas
against one batch of N x B, without shuffling, with gradients accumulated over two micro-batches
and clipped.
"""

import glob
import os
import subprocess
import sys

import conftest
import pytest
import torch
from conftest import Regressor, make_data, make_loader, subprocess_timeout
from native_run import InOrderShards
from tbparse import SummaryReader
from torch import nn

from xtrainer import Trainer, _xla
from xtrainer.callbacks import Callback, EarlyStopping, ModelCheckpoint
from xtrainer.checkpoint import CheckpointError, consolidate
from xtrainer.strategies import STRATEGIES, ModelParallelStrategy, XlaFSDP, XlaSPMD, shared_process
from xtrainer.strategies.launchers import CpuThreadReplicas, ReplicaFailure

pytestmark = pytest.mark.multi_device

GLOBAL_BATCH = 8
EPOCHS = 2
# Gradients accumulated over two micro-batches and clipped: both must act on the gradients
# reduced across replicas, so the replicas still match one replica on the global batches.
ACCUMULATE = dict(accumulate_grad_batches=2, gradient_clip_val=0.5)


class SyncedRegressor(Regressor):
    """Logs values reduced over replicas (``sync_dist=True``) with each reduction."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        self.log("rows", x.new_tensor(float(len(x))), on_step=False, on_epoch=True, reduce_fx="sum",
                 sync_dist=True)
        self.log("biggest", x.abs().max(), on_step=False, on_epoch=True, reduce_fx="max", sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)


class UnevenStart(Callback):
    """Replicas other than rank 0 start from other weights: DDP must give them rank 0's."""

    def setup(self, trainer, module, stage):
        if trainer.global_rank:
            with torch.no_grad():
                for p in module.parameters():
                    p.add_(1.0)


class Recorder(Callback):
    """Each replica writes ``rank-R.pt``: the samples it trained on in the first epoch, its whole
    weights at the end, its step count and metrics."""

    def __init__(self, folder):
        self.folder = str(folder)
        self.seen = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.current_epoch == 0:
            self.seen += batch[0][:, 0].cpu().tolist()  # host read in a test: which samples came

    def on_fit_end(self, trainer, module):
        weights = _xla.to_cpu(trainer.strategy.full_module_state_dict(trainer.model))  # all ranks gather
        torch.save({"rank": trainer.global_rank, "world_size": trainer.world_size, "seen": self.seen,
                    "weights": weights, "global_step": trainer.global_step,
                    "replicas_in_process": shared_process.current().replicas(),
                    "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}},
                   os.path.join(self.folder, f"rank-{trainer.global_rank}.pt"))


class InOrder(InOrderShards):
    """The training data shared out in order (sample i to replica i % N: the same global batches
    at every replica count), and the validation data."""

    def val_dataloader(self):
        return make_loader(n=16, seed=1, batch_size=self.batch_size)


def train(tmp_path, strategy, devices, module=None, callbacks=(), **kwargs):
    batch = GLOBAL_BATCH // devices
    model = module or SyncedRegressor()
    kwargs = {"max_epochs": EPOCHS, "log_every_n_steps": 1, **kwargs}
    trainer = Trainer(strategy=strategy, devices=devices, default_root_dir=str(tmp_path), enable_progress_bar=False,
                      callbacks=[Recorder(tmp_path), *callbacks], **kwargs)
    trainer.fit(model, datamodule=InOrder(make_data(), batch))
    replicas = [torch.load(path, weights_only=False) for path in sorted(glob.glob(str(tmp_path / "rank-*.pt")))]
    return trainer, model, replicas


_runs = {}


def run(tmp_path_factory, strategy, devices):
    """One fit per (strategy, devices), shared by the tests that read it."""
    key = (strategy, devices)
    if key not in _runs:
        callbacks = [UnevenStart()] if strategy == "xla_ddp" else []
        _runs[key] = train(tmp_path_factory.mktemp(f"{strategy}-{devices}"), strategy, devices, callbacks=callbacks,
                           **ACCUMULATE)
    return _runs[key]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One replica, one batch of the global size."""
    return train(tmp_path_factory.mktemp("reference"), "xla_native", 1, **ACCUMULATE)


# Every MPMD strategy (FSDP as ZeRO-3) at 2 replicas; at 4, DDP (the channel-id collectives and the thread pool at 4 are
# the same for every strategy, which agree with each other at 2 here).
# Every MPMD strategy at 2 replicas (``native`` is one device only; SPMD ones are in test_spmd.py).
# (native_ft: replica groups under a lighthouse, tests/stories/native/test_fault_tolerance.py; model_parallel: a
# module that parallelizes itself in configure_model, tests/stories/native/test_native_model_parallel.py)
CASES = [(s, 2) for s, cls in STRATEGIES.items()
         if not issubclass(cls, (XlaSPMD, ModelParallelStrategy)) and s != "native" and cls.runs_standalone]
CASES += [("xla_ddp", 4)]
IDS = [f"{s}-{n}" for s, n in CASES]


@pytest.mark.parametrize("strategy, devices", CASES, ids=IDS)
def test_replicas_agree_with_each_other_and_with_one_replica(tmp_path_factory, reference, strategy, devices):
    trainer, model, replicas = run(tmp_path_factory, strategy, devices)
    _, ref_model, (ref,) = reference
    assert [r["rank"] for r in replicas] == list(range(devices))
    assert {r["world_size"] for r in replicas} == {devices}
    for r in replicas[1:]:  # FSDP: these are the consolidated (gathered) weights
        for name, tensor in replicas[0]["weights"].items():
            assert torch.equal(tensor, r["weights"][name]), (name, r["rank"])
    for name, tensor in ref_model.state_dict().items():
        assert torch.allclose(replicas[0]["weights"][name], tensor, atol=1e-5), name
        assert torch.equal(model.state_dict()[name], replicas[0]["weights"][name]), name  # rank 0's came back
    assert trainer.global_step == ref["global_step"] == EPOCHS * 64 // GLOBAL_BATCH // 2  # two micro-batches a step
    # Thread replicas install what they share in their own process only; one process per replica shares nothing.
    threads = isinstance(trainer.strategy.launcher, CpuThreadReplicas)
    assert {r["replicas_in_process"] for r in replicas} == {devices if threads else 1}
    assert ref["replicas_in_process"] == shared_process.current().replicas() == 1  # the calling process


@pytest.mark.parametrize("strategy, devices", CASES, ids=IDS)
def test_each_replica_sees_its_own_share_of_the_data(tmp_path_factory, strategy, devices):
    _, _, replicas = run(tmp_path_factory, strategy, devices)
    shares = [set(r["seen"]) for r in replicas]
    assert all(len(share) == 64 // devices for share in shares)
    assert len(set.union(*shares)) == 64  # distinct, and together all of them
    assert set.union(*shares) == set(make_data().tensors[0][:, 0].tolist())


@pytest.mark.parametrize("strategy, devices", CASES, ids=IDS)
def test_synced_metrics_are_the_global_values(tmp_path_factory, reference, strategy, devices):
    trainer, _, replicas = run(tmp_path_factory, strategy, devices)
    _, _, (ref,) = reference
    expected = ref["metrics"]
    assert trainer.callback_metrics["rows"] == expected["rows"] == 64.0
    assert trainer.callback_metrics["biggest"] == expected["biggest"] == make_data().tensors[0].abs().max().item()
    for name in ("val_loss", "train_loss_epoch", "train_loss_step"):
        assert float(trainer.callback_metrics[name]) == pytest.approx(expected[name], rel=1e-5), name
        for r in replicas:  # every replica holds the same reduced values
            assert r["metrics"][name] == trainer.callback_metrics[name], (name, r["rank"])


def test_rank_zero_logs_and_results_come_back(tmp_path_factory):
    trainer, _, _ = run(tmp_path_factory, "xla_native", 2)
    assert trainer.current_epoch == EPOCHS
    events = SummaryReader(trainer.log_dir).scalars
    assert events[events.tag == "val_loss"].step.tolist() == [3, 7]  # written once, by rank 0
    assert len(glob.glob(os.path.join(trainer.log_dir, "events.out.tfevents.*"))) == 1
    (saver,) = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]
    assert os.path.exists(saver.best_model_path)  # the default ModelCheckpoint's state came back


class WiderOnRankOne(Callback):
    """Replica 1 builds its last layer with two outputs, replica 0 with one."""

    def setup(self, trainer, module, stage):
        if trainer.global_rank:
            module.net[2] = nn.Linear(16, 2)


def test_ddp_on_thread_replicas_starts_through_their_rendezvous_and_names_a_replica_of_other_shapes(trainer_kwargs):
    # DDP's own start (init_sync) reads device tensors outside the thread replicas' serialised graph
    # cut; their process starts it instead (installed when it starts), and says which replica differs.
    trainer = Trainer(strategy="xla_ddp", devices=2, max_epochs=1, callbacks=[WiderOnRankOne()], **trainer_kwargs)
    with pytest.raises(RuntimeError, match=r"DistributedDataParallel: replica [01] holds parameters or buffers of "
                                           r"other shapes or dtypes than replica [01]; every replica must build"):
        trainer.fit(Regressor(), make_loader())


class IntegerCollective(Callback):
    """Reduces an integer tensor through the process group, as DDP's reducer reduces its map of
    the parameters each replica used, then reads it as the reducer does (from C++)."""

    def __init__(self, folder):
        self.folder = folder

    def on_train_start(self, trainer, module):
        import torch.distributed as dist

        counts = torch.full((3,), trainer.global_rank + 1, dtype=torch.int32).to(trainer.strategy.device)
        dist.all_reduce(counts)
        computed = _xla.is_computed(counts)
        with open(os.path.join(self.folder, f"rank-{trainer.global_rank}.txt"), "w") as f:
            f.write(f"{computed} {counts.cpu().tolist()}")


def test_integer_collectives_of_the_process_group_are_computed_before_torch_reads_them_from_cpp(tmp_path,
                                                                                                trainer_kwargs):
    # Read from C++ (a Tensor.cpu() no Python patch sees), a pending result ran its graph outside
    # the serialised cut in both replicas at once: with find_unused_parameters=True, DDP's reducer
    # did so at every backward.
    trainer = Trainer(strategy="xla_ddp", devices=2, max_steps=1, callbacks=[IntegerCollective(str(tmp_path))],
                      **trainer_kwargs)
    trainer.fit(Regressor(), make_loader())
    for rank in (0, 1):
        with open(tmp_path / f"rank-{rank}.txt") as f:
            assert f.read() == "True [3, 3, 3]"


class StopOnRankOne(Callback):
    """Asks to stop on replica 1 only, after ``step`` optimizer steps."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step == self.step:
            trainer.should_stop = True


@pytest.mark.parametrize("log_every, stopped_at", [(1, 4), (100, 8)])
def test_a_stop_asked_on_one_replica_stops_all_together(tmp_path, log_every, stopped_at):
    # The request is shared at the next logging step, or at the epoch's end (8 steps) at the latest.
    trainer, _, replicas = train(tmp_path, "xla_native", 2, callbacks=[StopOnRankOne(3)],
                                 log_every_n_steps=log_every, logger=False)
    assert [r["global_step"] for r in replicas] == [stopped_at, stopped_at]
    assert trainer.global_step == stopped_at and trainer.should_stop


class RankScores(Regressor):
    """``score`` improves every epoch on replica 0 and never on replica 1 (not synced)."""

    def on_validation_epoch_end(self):
        epoch = float(self.current_epoch)
        self.log("score", epoch if self.trainer.global_rank == 1 else -epoch)


def test_early_stopping_on_one_replica_stops_all(tmp_path):
    stopper = EarlyStopping("score", patience=2)
    trainer, _, replicas = train(tmp_path, "xla_native", 2, module=RankScores(), callbacks=[stopper], max_epochs=10,
                                 logger=False)
    assert trainer.current_epoch == 3 and trainer.should_stop  # replica 1 lost patience after epoch 2
    assert [r["global_step"] for r in replicas] == [24, 24]  # 3 epochs of 8 steps, on both
    assert stopper.stopped_epoch == 0  # rank 0's own EarlyStopping never asked to stop (Lightning's 0: not stopped)


class FailsOnRankOne(Regressor):
    def training_step(self, batch, batch_idx):
        if self.trainer.global_rank == 1 and self.trainer.global_step == 2:
            raise ValueError("a bad batch on replica 1")
        return super().training_step(batch, batch_idx)


def test_a_failing_replica_stops_the_others_and_its_error_is_raised(tmp_path):
    with pytest.raises(ValueError, match="a bad batch on replica 1") as info:
        train(tmp_path, "xla_ddp", 2, module=FailsOnRankOne(), logger=False)
    assert any("replica 1 of 2" in note for note in info.value.__notes__)
    cause = info.value.__cause__
    assert isinstance(cause, ReplicaFailure) and "in training_step" in str(cause)
    assert not glob.glob(str(tmp_path / "rank-*.pt"))  # nobody finished the fit


def test_fsdp_replicas_write_one_shard_each_that_consolidate_and_resume_only_at_their_size(tmp_path):
    trainer, model, _ = train(tmp_path / "two", "xla_fsdp", 2, max_epochs=1, logger=False)
    path = os.path.join(trainer.log_dir, "checkpoints", "epoch=0-step=8.ckpt")
    assert sorted(os.listdir(path)) == ["manifest.json", "rank-00000-of-00002.pt", "rank-00001-of-00002.pt",
                                        "trainer.pt"]
    full = consolidate(path)
    assert set(full) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(full[name], tensor), name
    for devices in (1, 4):
        with pytest.raises(CheckpointError, match=f"written by xla_fsdp with 2 replica.*xla_fsdp at world size "
                           f"{devices} cannot resume it.*consolidate"):
            Trainer(strategy=XlaFSDP(), devices=devices, max_epochs=2, default_root_dir=str(tmp_path / "again"),
                    enable_progress_bar=False, logger=False).fit(
                Regressor(), make_loader(batch_size=GLOBAL_BATCH // devices), ckpt_path=path)


@pytest.mark.slow
def test_digits_with_two_replicas_from_the_command_line(tmp_path):
    # No environment prepared: PJRT_DEVICE unset lets torch_xla pick the CPU, as on a laptop.
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    script = os.path.join(os.path.dirname(conftest.__file__), "..", "examples", "digits.py")
    done = subprocess.run([sys.executable, script, "trainer.devices=2", "trainer.strategy=xla_ddp",
                           f"trainer.default_root_dir={tmp_path}", "trainer.enable_progress_bar=false"],
                          capture_output=True, text=True, env=env, timeout=subprocess_timeout(600))
    assert done.returncode == 0, done.stderr[-3000:]
    accuracy = float(done.stdout.split("validation accuracy:")[1])
    assert accuracy >= 0.95
    assert done.stdout.count("validation accuracy:") == 1  # printed by the calling process only
    events = [name for name in os.listdir(tmp_path / "version_0") if name.startswith("events.out.tfevents")]
    assert len(events) == 1


def test_what_cannot_be_sent_to_the_replicas_is_named(tmp_path):
    class Local(Regressor):  # defined inside a function: pickle cannot find it by name
        pass

    with pytest.raises(TypeError, match="Define classes and functions at the top level"):
        Trainer(devices=2, default_root_dir=str(tmp_path), logger=False).fit(Local(), make_loader())


class LogsItsRank(Regressor):
    """Logs its rank as a Python number with ``sync_dist=True``, per step and per epoch."""

    def training_step(self, batch, batch_idx):
        self.log("rank_mean", float(self.global_rank), on_step=True, on_epoch=True, sync_dist=True)
        self.log("rank_max", self.global_rank, on_step=False, on_epoch=True, reduce_fx="max", sync_dist=True)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("log_every_n_steps", [1, 50])
def test_a_number_logged_with_sync_dist_is_reduced_across_replicas(tmp_path, log_every_n_steps):
    """A Python number (not a tensor) logged with ``sync_dist=True`` is reduced like a tensor: the
    all-reduce took only device tensors and the fit failed ("Expected XLA tensor")."""
    trainer = Trainer(strategy="xla_ddp", devices=2, max_epochs=1, log_every_n_steps=log_every_n_steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path))
    trainer.fit(LogsItsRank(), make_loader(16, batch_size=4))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert metrics["rank_mean_step"] == metrics["rank_mean_epoch"] == 0.5
    assert metrics["rank_max"] == 1.0


def test_a_checkpoint_every_n_train_steps_monitors_a_sync_dist_value_reduced_across_replicas(tmp_path):
    """Between logging steps, ``ModelCheckpoint(every_n_train_steps=...)`` ranks by the step's value
    reduced across the replicas (Lightning's), never by rank 0's own (0.0 here) or by nothing."""
    checkpoints = ModelCheckpoint(dirpath=str(tmp_path / "ck"), monitor="rank_mean_step", save_top_k=-1,
                                  every_n_train_steps=1)
    trainer = Trainer(strategy="xla_ddp", devices=2, max_epochs=1, log_every_n_steps=50, logger=False,
                      callbacks=[checkpoints], enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path))
    trainer.fit(LogsItsRank(), make_loader(16, batch_size=4))
    assert len(checkpoints.best_k_models) == 2  # two steps per replica, each checkpoint scored
    assert [float(score) for score in checkpoints.best_k_models.values()] == [0.5, 0.5]
