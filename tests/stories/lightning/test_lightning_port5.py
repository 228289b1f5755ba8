"""Lightning project code, set four: what real projects call that Lightning accepts.

- a custom logger written as Lightning's docs write one (``log_hyperparams(self, params)``);
- ``trainer.strategy.barrier()``, ``.broadcast(obj, src)``, ``.reduce(tensor)``,
  ``.all_gather(tensor)``, ``.reduce_boolean_decision(flag)`` and ``.root_device``;
- ``self.all_gather(x, sync_grads=True)`` (contrastive losses), on one process and on two;
- ``self.log`` in a ``*_step`` called without a Trainer (a unit test of the module);
- ``trainer.state.fn``, ``.stage``, ``.status`` with Lightning's enums;
- ``seed_everything()`` without a seed, and ``verbose``;
- the default ``predict_step``: ``self(batch)``, the whole batch.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import make_data
from lightning_utilities.core.rank_zero import rank_zero_only
from torch import nn
from torch.utils.data import DataLoader

from xtrainer import Trainer, seed_everything
from xtrainer import XModule as LightningModule
from xtrainer.callbacks import Callback
from xtrainer.loggers import Logger
from xtrainer.states import RunningStage, TrainerFn, TrainerStatus


def _loader(n=32, batch_size=8):
    return DataLoader(make_data(n), batch_size=batch_size)


class Small(LightningModule):
    def __init__(self, lr: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.layer = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def _quiet(tmp_path, **kwargs):
    return dict(default_root_dir=str(tmp_path), enable_progress_bar=False, enable_model_summary=False,
                enable_checkpointing=False, **kwargs)


# ---- a custom logger as Lightning's docs write one -------------------------------------------
class DocsLogger(Logger):
    """Lightning's "Make a custom logger" example, word for word but the imports."""

    def __init__(self):
        super().__init__()
        self.params, self.metrics, self.finalized = [], [], []

    @property
    def name(self):
        return "MyLogger"

    @property
    def version(self):
        return "0.1"

    @rank_zero_only
    def log_hyperparams(self, params):
        self.params.append(dict(params))

    @rank_zero_only
    def log_metrics(self, metrics, step):
        self.metrics.append((step, dict(metrics)))

    @rank_zero_only
    def save(self):
        pass

    @rank_zero_only
    def finalize(self, status):
        self.finalized.append(status)


def test_a_custom_logger_with_lightnings_one_argument_log_hyperparams_gets_the_params_and_the_fit_ends(tmp_path):
    logger = DocsLogger()
    trainer = Trainer(max_epochs=1, logger=logger, log_every_n_steps=1, **_quiet(tmp_path))
    trainer.fit(Small(lr=0.1), _loader())  # raised TypeError at the fit's end: a second argument it cannot take
    assert logger.params == [{"lr": 0.1}]  # once, at the start, as Lightning calls it
    assert len(logger.metrics) == 4 and all("train_loss" in metrics for _, metrics in logger.metrics)
    assert logger.finalized == ["success"]


def test_a_logger_that_takes_the_final_metrics_still_gets_them(tmp_path):
    class WithMetrics(DocsLogger):
        @rank_zero_only
        def log_hyperparams(self, params, metrics=None):
            self.params.append((dict(params), None if metrics is None else sorted(metrics)))

    logger = WithMetrics()
    Trainer(max_epochs=1, logger=logger, **_quiet(tmp_path)).fit(Small(), _loader(), _loader(16))
    assert logger.params == [({"lr": 0.1}, None), ({"lr": 0.1}, ["train_loss", "val_loss"])]


# ---- self.log without a Trainer ----------------------------------------------------------------
def test_self_log_in_a_step_called_without_a_trainer_warns_and_the_step_returns_its_loss():
    model = Small()
    x, y = make_data(8)[:]
    with pytest.warns(UserWarning, match=r"self.log\('train_loss'\): Small is not attached to a Trainer"):
        loss = model.training_step((x, y), 0)
    assert loss.shape == () and loss.requires_grad


# ---- Lightning's collectives on the strategy -----------------------------------------------------
class Collects(Small):
    """Calls each of Lightning's strategy collectives once the fit has started, and writes what
    each replica saw to ``out/rank-R.json``."""

    def __init__(self, out: str):
        super().__init__()
        self.out = out

    def on_train_start(self):
        strategy, rank = self.trainer.strategy, self.global_rank
        world = self.trainer.world_size
        strategy.barrier()
        strategy.barrier("named")
        seen = {
            "root_device": str(strategy.root_device), "device": str(self.device),
            "broadcast": strategy.broadcast({"from": rank}),
            "broadcast_last": strategy.broadcast(f"rank {rank}", src=world - 1),
            "mean": strategy.reduce(torch.tensor([float(rank + 1)], device=self.device)).cpu().tolist(),
            "sum": strategy.reduce(torch.tensor([rank + 1.0], device=self.device), reduce_op="sum").cpu().tolist(),
            "max": strategy.reduce(torch.tensor([rank + 1.0], device=self.device), reduce_op="max").cpu().tolist(),
            "not_a_tensor": strategy.reduce(3),
            "gathered": strategy.all_gather(torch.tensor([rank], device=self.device)).cpu().tolist(),
            "all_true": strategy.reduce_boolean_decision(True),
            "all_rank0": strategy.reduce_boolean_decision(rank == 0),
            "any_rank0": strategy.reduce_boolean_decision(rank == 0, all=False),
            "any_none": strategy.reduce_boolean_decision(False, all=False),
        }
        with open(os.path.join(self.out, f"rank-{rank}.json"), "w") as f:
            json.dump(seen, f)


def _seen(out, world):
    return [json.load(open(os.path.join(out, f"rank-{r}.json"))) for r in range(world)]


def test_lightnings_strategy_collectives_on_one_device(tmp_path):
    Trainer(max_steps=1, logger=False, **_quiet(tmp_path)).fit(Collects(str(tmp_path)), _loader())
    [seen] = _seen(tmp_path, 1)
    assert seen["root_device"] == seen["device"] == "cpu"
    assert seen["broadcast"] == {"from": 0} and seen["broadcast_last"] == "rank 0"
    assert seen["mean"] == seen["sum"] == seen["max"] == [1.0] and seen["not_a_tensor"] == 3
    assert seen["gathered"] == [0]  # one replica: as it is, as in Lightning's single-device strategy
    assert seen["all_true"] and seen["all_rank0"] and seen["any_rank0"] and not seen["any_none"]


@pytest.mark.multi_device
@pytest.mark.parametrize("strategy", ["native_ddp", "xla_native"])
def test_lightnings_strategy_collectives_on_two_replicas(tmp_path, strategy):
    Trainer(strategy=strategy, devices=2, max_steps=1, logger=False, **_quiet(tmp_path)).fit(
        Collects(str(tmp_path)), _loader())
    for rank, seen in enumerate(_seen(tmp_path, 2)):
        assert seen["root_device"] == seen["device"]
        assert seen["broadcast"] == {"from": 0} and seen["broadcast_last"] == "rank 1"
        assert seen["mean"] == [1.5] and seen["sum"] == [3.0] and seen["max"] == [2.0], seen
        assert seen["gathered"] == [[0], [1]]
        assert seen["all_true"] and not seen["all_rank0"] and seen["any_rank0"] and not seen["any_none"]


# ---- self.all_gather(sync_grads=True) ------------------------------------------------------------
class Contrastive(Small):
    """A loss over every replica's outputs (SimCLR's and CLIP's pattern): each replica's gradient
    must reach its own outputs through the gather."""

    def __init__(self, out: str):
        super().__init__()
        self.out = out

    def training_step(self, batch, batch_idx):
        x, _ = batch
        if x.device.type != "meta":  # (the step's FLOPs are counted once on a copy on the meta device)
            torch.save(x, os.path.join(self.out, f"batch-{self.global_rank}.pt"))  # the shard this replica read
        z = self.layer(x)
        everyone = self.all_gather(z, sync_grads=True)
        if self.trainer.world_size > 1:
            everyone = everyone.reshape(-1, 1)
        loss = (everyone ** 2).mean()
        return loss

    def on_before_optimizer_step(self, optimizer):
        with open(os.path.join(self.out, f"grad-{self.global_rank}.json"), "w") as f:
            json.dump(self.layer.weight.grad.flatten().tolist(), f)


def test_all_gather_with_sync_grads_on_one_device_is_the_tensor_with_its_gradient(tmp_path):
    Trainer(max_steps=1, logger=False, **_quiet(tmp_path)).fit(Contrastive(str(tmp_path)), _loader())
    grad = json.load(open(tmp_path / "grad-0.json"))
    model = Small()
    x, _ = next(iter(_loader()))
    (model.layer(x) ** 2).mean().backward()
    assert grad == pytest.approx(model.layer.weight.grad.flatten().tolist(), abs=1e-7)


@pytest.mark.multi_device
def test_all_gather_with_sync_grads_on_two_processes_sends_each_its_gradient(tmp_path):
    """The loss over both replicas' outputs, with DDP averaging the replicas' gradients: the
    gradient of the whole loss over the global batch, as one process computes it on both shards.
    (Without a gradient through the gather, each replica would see only its own half's term.)"""
    Trainer(strategy="native_ddp", devices=2, max_steps=1, logger=False, **_quiet(tmp_path)).fit(
        Contrastive(str(tmp_path)), _loader())
    grads = [json.load(open(tmp_path / f"grad-{r}.json")) for r in range(2)]
    assert grads[0] == pytest.approx(grads[1], abs=1e-7)
    model = Small()
    shards = [torch.load(tmp_path / f"batch-{r}.pt") for r in range(2)]  # each rank's first batch
    both = torch.cat([model.layer(s) for s in shards])
    (both ** 2).mean().backward()  # DDP's mean over 2 replicas of (2 x the gathered gradient) / 2
    assert grads[0] == pytest.approx(model.layer.weight.grad.flatten().tolist(), abs=1e-6)


def test_all_gather_with_sync_grads_on_xlas_replicas_is_refused_in_one_line(tmp_path):
    trainer = Trainer(strategy="xla_native", devices=2, max_steps=1, logger=False, **_quiet(tmp_path))
    with pytest.raises(ValueError, match=r"sync_grads=True\) is not supported on XLA's replicas.*native_ddp"):
        trainer.fit(Contrastive(str(tmp_path)), _loader())


# ---- trainer.state as in Lightning -----------------------------------------------------------------
def test_trainer_state_has_lightnings_fn_stage_and_status(tmp_path):
    seen = []

    class Watch(Callback):
        def on_sanity_check_start(self, trainer, module):
            seen.append(("sanity", trainer.state.fn, trainer.state.stage, trainer.state.status))

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == 0:
                seen.append(("train", trainer.state.fn, trainer.state.stage, trainer.state.status))

        def on_validation_start(self, trainer, module):
            seen.append(("validate", trainer.state.fn, trainer.state.stage, trainer.state.status))

    trainer = Trainer(max_epochs=1, logger=False, callbacks=[Watch()], num_sanity_val_steps=1, **_quiet(tmp_path))
    assert trainer.state == "idle" and trainer.state.fn is None
    assert trainer.state.status == TrainerStatus.INITIALIZING and not trainer.state.stopped
    trainer.fit(Small(), _loader(), _loader(16))
    trainer.validate(Small(), _loader(16), verbose=False)
    assert seen == [
        ("sanity", TrainerFn.FITTING, RunningStage.SANITY_CHECKING, TrainerStatus.RUNNING),
        ("validate", TrainerFn.FITTING, RunningStage.SANITY_CHECKING, TrainerStatus.RUNNING),  # as in Lightning
        ("train", TrainerFn.FITTING, RunningStage.TRAINING, TrainerStatus.RUNNING),
        ("validate", TrainerFn.FITTING, RunningStage.VALIDATING, TrainerStatus.RUNNING),
        ("validate", TrainerFn.VALIDATING, RunningStage.VALIDATING, TrainerStatus.RUNNING),
    ]
    assert seen[2][1] == "fit" and seen[2][2] == "train"  # str enums: the plain names compare equal
    assert trainer.state == "idle" and trainer.state.fn == TrainerFn.VALIDATING and trainer.state.stage is None
    assert trainer.state.status == TrainerStatus.FINISHED and trainer.state.finished and trainer.state.stopped


class Fails(Small):
    def training_step(self, batch, batch_idx):
        raise RuntimeError("bad batch")


def test_trainer_state_is_interrupted_after_a_run_that_raised(tmp_path):
    trainer = Trainer(max_epochs=1, logger=False, **_quiet(tmp_path))
    with pytest.raises(RuntimeError, match="bad batch"):
        trainer.fit(Fails(), _loader())
    assert trainer.state.fn == TrainerFn.FITTING and trainer.state.status == TrainerStatus.INTERRUPTED
    assert trainer.state.stopped and not trainer.state.finished


# ---- seed_everything as in Lightning -----------------------------------------------------------------
def test_seed_everything_without_a_seed_reads_pl_global_seed_or_takes_0(monkeypatch):
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    monkeypatch.delenv("PL_SEED_WORKERS", raising=False)
    with pytest.warns(UserWarning, match="no seed given; seed set to 0"):
        assert seed_everything() == 0
    assert os.environ["PL_GLOBAL_SEED"] == "0" and os.environ["PL_SEED_WORKERS"] == "0"
    first = torch.rand(3)
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    assert seed_everything(None, workers=True, verbose=False) == 7 and os.environ["PL_SEED_WORKERS"] == "1"
    seeded = torch.rand(3)
    seed_everything(7, verbose=False)
    assert torch.equal(torch.rand(3), seeded) and not torch.equal(first, seeded)
    with pytest.warns(UserWarning, match=r"seed_everything\(-1\): NumPy takes seeds from 0"):
        assert seed_everything(-1) == 0
    monkeypatch.setenv("PL_GLOBAL_SEED", "abc")
    with pytest.warns(UserWarning, match="PL_GLOBAL_SEED='abc' is not a number"):
        assert seed_everything() == 0


@pytest.mark.multi_device
def test_trainer_state_after_a_run_of_xlas_thread_replicas_is_the_callers_too(tmp_path):
    """The replicas run on copies of the Trainer (threads of this process): what ran and how it
    ended still reach the caller's ``trainer.state``."""
    trainer = Trainer(strategy="xla_native", devices=2, max_steps=2, logger=False, **_quiet(tmp_path))
    trainer.fit(Small(), _loader())
    assert trainer.state.fn == TrainerFn.FITTING and trainer.state.status == TrainerStatus.FINISHED

    failing = Trainer(strategy="xla_native", devices=2, max_steps=2, logger=False, **_quiet(tmp_path))
    with pytest.raises(RuntimeError, match="bad batch"):
        failing.fit(Fails(), _loader())
    assert failing.state.fn == TrainerFn.FITTING and failing.state.status == TrainerStatus.INTERRUPTED


@pytest.mark.parametrize("strategy,devices", [("native", 1), pytest.param("xla_native", 2, marks=pytest.mark.multi_device)])
def test_trainer_model_is_none_before_a_run_and_the_module_after_one(tmp_path, strategy, devices):
    trainer = Trainer(strategy=strategy, devices=devices, max_steps=2, logger=False, **_quiet(tmp_path))
    assert trainer.model is None  # as in Lightning: no module yet
    model = Small()
    trainer.fit(model, _loader())
    assert trainer.model is model  # given back unwrapped, as Lightning's strategies leave it after teardown


class PairForward(Small):
    """A module whose ``forward`` takes the whole batch, as Lightning's default ``predict_step``
    hands it over: here an ``(inputs, mask)`` pair."""

    def forward(self, batch):
        x, mask = batch
        return self.layer(x) * mask


def test_the_default_predict_step_gives_forward_the_whole_batch_as_lightning_does(tmp_path):
    x, mask = torch.randn(6, 8), torch.tensor([[1.0], [0.0], [1.0], [1.0], [0.0], [1.0]])
    loader = DataLoader(torch.utils.data.TensorDataset(x, mask), batch_size=2)  # pairs of two rows
    model = PairForward()
    out = Trainer(strategy="native", logger=False, **_quiet(tmp_path)).predict(model, loader)
    with torch.no_grad():  # not the inputs alone: with two rows they would unpack as (row 0, row 1)
        assert torch.equal(torch.cat(out), model.layer(x) * mask)
        assert torch.equal(model.predict_step(batch=(x, mask)), model.layer(x) * mask)  # batch= as a keyword
