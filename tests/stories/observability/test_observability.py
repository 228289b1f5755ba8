"""What a run shows: TensorBoard scalars and hyperparameters, XLA health, the progress bar."""

import glob
import io
import os
import time

import pytest
import torch
from conftest import Regressor, make_data, make_loader
from tbparse import SummaryReader
from torch import nn

from xtrainer import Trainer, _xla
from xtrainer.callbacks import ProgressBar, RecompilationError, TensorBoardLogger, XlaHealth, XlaProfiler


def test_event_files_hold_logged_values_lr_epoch_health_and_hparams(tmp_path):
    trainer = Trainer(strategy="xla_native", max_epochs=2, log_every_n_steps=2, default_root_dir=str(tmp_path), enable_progress_bar=False,
                      enable_checkpointing=False)
    model = Regressor(lr=0.05)
    model.save_hyperparameters(width=16)
    trainer.fit(model, make_loader(), make_loader(n=16, seed=1))
    scalars = SummaryReader(trainer.log_dir).scalars
    tags = set(scalars.tag)
    assert {"train_loss_step", "train_loss_epoch", "val_loss", "epoch", "lr-SGD/pg0"} <= tags
    assert {"xla/compilations", "xla/compile_seconds", "xla/executions", "xla/transfers_to_host",
            "throughput/steps_per_second", "throughput/samples_per_second"} <= tags
    lr = scalars[scalars.tag == "lr-SGD/pg0"]
    assert all(v == pytest.approx(0.05) for v in lr.value) and lr.step.tolist()[:3] == [1, 3, 5]
    assert sorted(set(scalars[scalars.tag == "epoch"].value)) == [0.0, 1.0]
    val = scalars[scalars.tag == "val_loss"]
    assert val.step.tolist() == [7, 15] and val.value.iloc[-1] == pytest.approx(trainer.callback_metrics["val_loss"])
    samples = scalars[scalars.tag == "throughput/samples_per_second"].value
    steps = scalars[scalars.tag == "throughput/steps_per_second"].value
    assert all(s > 0 for s in steps) and all(abs(a / b - 8) < 1e-6 for a, b in zip(samples, steps))
    hparams = SummaryReader(trainer.log_dir).hparams
    recorded = dict(zip(hparams.tag, hparams.value))
    assert recorded["trainer/strategy"] == "xla_native" and recorded["width"] == 16


def transfers(tmp_path, **kwargs):
    _xla.clear_metrics()
    trainer = Trainer(strategy="xla_native", max_epochs=3, log_every_n_steps=4, default_root_dir=str(tmp_path), enable_checkpointing=False,
                      **kwargs)
    trainer.fit(Regressor(), make_loader(), make_loader(n=16, seed=1))
    return _xla.transfer_from_device_count()


def test_logger_progress_bar_and_health_add_no_device_reads(tmp_path):
    quiet = transfers(tmp_path / "quiet", logger=False, enable_progress_bar=False, enable_xla_health=False)
    shown = transfers(tmp_path / "shown", logger=True, enable_progress_bar=True, enable_xla_health=True)
    assert shown == quiet
    # 24 steps: 6 logging steps, 3 validation ends, 3 training epoch ends, the sanity check's
    # validation end; then the 4 weight tensors
    assert quiet == 6 + 3 + 3 + 1 + len(list(Regressor().parameters()))


class ShapeShifter:
    """The default data as 8 batches of 8, except that batch 3 is shorter from the second epoch on."""

    def __init__(self, rows):
        self.data, self.epochs, self.rows = make_data(), 0, rows

    def __len__(self):
        return 8

    def __iter__(self):
        x, y = self.data.tensors
        for i in range(8):
            rows = self.rows if self.epochs >= 1 and i == 3 else 8
            yield x[8 * i:8 * i + rows], y[8 * i:8 * i + rows]
        self.epochs += 1


def test_a_recompilation_is_reported_with_its_step_and_shapes(tmp_path):
    health = XlaHealth()
    trainer = Trainer(strategy="xla_native", max_epochs=3, default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False,
                      enable_checkpointing=False, callbacks=[health])
    with pytest.warns(UserWarning, match="recompiled .* at step 12 \\(epoch 1, training batch 3\\).*"
                                         "shapes \\(\\(5, 8\\), \\(5, 1\\)\\) had no graph compiled for them"):
        trainer.fit(Regressor(), ShapeShifter(5))
    assert [r["step"] for r in health.recompilations][:1] == [12]
    assert health.totals["recompilations"] >= 1 and health.totals["steps"] == 24
    strict = Trainer(strategy="xla_native", max_epochs=3, default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False,
                     enable_checkpointing=False, callbacks=[XlaHealth(on_recompile="raise")])
    with pytest.raises(RecompilationError, match="at step 12"):  # another shape: graphs are cached per process
        strict.fit(Regressor(), ShapeShifter(6))


class ChangesItsStepAfterTheFirstEpoch(Regressor):
    """From the third batch of the second epoch on, its step holds an op of a size no other run
    has used (a new graph for the same inputs; the second epoch's first step still warms up)."""

    size = 1000 + os.getpid() % 1000 + int(time.time() * 1000) % 997

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.current_epoch >= 1 and batch_idx >= 2:
            loss = loss + torch.zeros(self.size, device=loss.device).sum()
        return loss


def test_a_recompilation_after_a_first_epoch_that_compiled_nothing_names_the_right_cause(tmp_path):
    """The first epoch's graphs were compiled by an earlier fit of this process, so it compiled
    none itself; its second epoch compiles a new graph for the same shapes. The warning says that
    the shapes are those of the first epoch, not that they are new."""
    kwargs = dict(default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False, enable_checkpointing=False)
    Trainer(strategy="xla_native", max_epochs=1, **kwargs).fit(ChangesItsStepAfterTheFirstEpoch(), make_loader())  # the first epoch's graphs
    health = XlaHealth()
    trainer = Trainer(strategy="xla_native", max_epochs=2, callbacks=[health], **kwargs)
    with pytest.warns(UserWarning, match="recompiled .* the inputs' shapes are as in the first epoch"):
        trainer.fit(ChangesItsStepAfterTheFirstEpoch(), make_loader())
    assert health.recompilations and all("first epoch, so something inside" in r["reason"]
                                         for r in health.recompilations), health.recompilations


def test_a_steady_run_reports_no_recompilation_and_a_summary(tmp_path, capsys):
    health = XlaHealth(on_recompile="raise")
    trainer = Trainer(strategy="xla_native", max_epochs=3, default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False,
                      enable_checkpointing=False, callbacks=[health])
    trainer.fit(Regressor(), make_loader(), make_loader(n=16, seed=1))
    assert health.recompilations == [] and health.totals["recompilations"] == 0
    assert "fit: 24 steps in" in capsys.readouterr().out


def test_progress_bar_lines_off_a_terminal_and_a_rich_bar_on_one(tmp_path):
    plain = io.StringIO()
    Trainer(strategy="xla_native", max_epochs=1, log_every_n_steps=4, default_root_dir=str(tmp_path), logger=False, enable_checkpointing=False,
            callbacks=[ProgressBar(plain)]).fit(Regressor(), make_loader())
    lines = plain.getvalue().splitlines()
    assert lines[0].startswith("epoch 0 batch 4/8 step 4") and "loss=" in lines[0] and lines[-1].startswith("epoch 0 done")
    fancy = io.StringIO()
    Trainer(strategy="xla_native", max_epochs=2, log_every_n_steps=4, default_root_dir=str(tmp_path), logger=False, enable_checkpointing=False,
            callbacks=[ProgressBar(fancy, rich=True)]).fit(Regressor(), make_loader())
    out = fancy.getvalue()
    assert "epoch 1" in out and "8/8" in out and "it/s" in out and "\x1b[" in out  # drawn with terminal codes


class BarModel(Regressor):
    """Logs its training loss per step and per epoch, and a validation value, on the bar."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), prog_bar=True)


def test_progress_bar_shows_the_users_names_and_no_stale_epoch_values(tmp_path):
    plain = io.StringIO()
    Trainer(strategy="xla_native", max_epochs=2, log_every_n_steps=4, default_root_dir=str(tmp_path), logger=False, enable_checkpointing=False,
            num_sanity_val_steps=0, callbacks=[ProgressBar(plain)]).fit(BarModel(), make_loader(),
                                                                        make_loader(n=16, seed=1))
    lines = plain.getvalue().splitlines()
    names = [{value.split("=")[0] for value in line.split(") ", 1)[1].split()} for line in lines]
    assert [line.split(" step")[0] for line in lines] == ["epoch 0 batch 4/8", "epoch 0 batch 8/8", "epoch 0 done",
                                                         "epoch 1 batch 4/8", "epoch 1 batch 8/8", "epoch 1 done"]
    assert names[0] == {"train_loss_step", "flop/s"}  # not also loss= with the same value
    assert names[2] == {"train_loss_step", "train_loss_epoch", "val_loss", "flop/s"}  # the epoch's values at its end
    assert names[3] == {"train_loss_step", "val_loss", "flop/s"}  # epoch 1, mid-way: epoch 0's train_loss_epoch is gone
    assert names[5] == {"train_loss_step", "train_loss_epoch", "val_loss", "flop/s"}
    epoch_end = [float(v.split("=")[1]) for v in lines[2].split() if v.startswith("train_loss_epoch=")]
    assert epoch_end and all(f"train_loss_epoch={epoch_end[0]:.4g}" not in line for line in lines[3:5])


def test_no_progress_bar_when_turned_off(tmp_path, capsys):
    Trainer(strategy="xla_native", max_epochs=1, default_root_dir=str(tmp_path), logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_xla_health=False, enable_model_summary=False).fit(Regressor(), make_loader())
    assert capsys.readouterr().out == ""


def test_profiler_traces_the_chosen_steps_into_the_run_folder(tmp_path):
    profiler = XlaProfiler(start_step=10, num_steps=3)
    trainer = Trainer(strategy="xla_native", max_epochs=2, default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False,
                      enable_checkpointing=False, callbacks=[profiler])
    trainer.fit(Regressor(), make_loader())
    assert profiler.traced_steps == [11, 12, 13] and profiler.port
    traces = glob.glob(os.path.join(trainer.log_dir, "plugins", "profile", "*", "*.xplane.pb"))
    assert len(traces) == 1 and os.path.getsize(traces[0]) > 0


def test_a_named_logger_puts_the_run_folder_under_its_name(tmp_path):
    trainer = Trainer(strategy="xla_native", max_epochs=1, default_root_dir=str(tmp_path), enable_progress_bar=False,
                      logger=TensorBoardLogger(name="exp"))
    trainer.fit(Regressor(), make_loader())
    assert trainer.log_dir == str(tmp_path / "exp" / "version_0")
    assert set(SummaryReader(trainer.log_dir).scalars.tag) >= {"train_loss_epoch", "epoch"}
    assert os.path.exists(os.path.join(trainer.log_dir, "checkpoints", "last.ckpt"))
    again = Trainer(strategy="xla_native", max_epochs=2, default_root_dir=str(tmp_path), enable_progress_bar=False,
                    logger=TensorBoardLogger(name="exp"))
    again.fit(Regressor(), make_loader(), ckpt_path="last")  # found under exp/
    assert again.log_dir.endswith("version_1") and again.global_step == 16


class FakeTrainer:
    """What ``XlaHealth`` reads of a Trainer, for its arithmetic."""

    def __init__(self, world_size):
        from xtrainer.strategies import XlaNative

        self.world_size, self.global_step, self.checkpoint_compilations = world_size, 0, 0
        self.accumulate_grad_batches = 1
        self.is_global_zero, self.state, self.current_epoch = True, "fit", 0
        self.strategy = XlaNative()  # its counters are torch_xla's, as _xla reads them


@pytest.mark.parametrize("threads, expected", [
    (False, "fit: 88 steps in 2.0 s (44.0 steps/s, 0 samples/s); 14 compilations (6.0 s), 0 after the first epoch; "
            "2.00 device-to-host transfers per step"),
    (True, "fit: 88 steps in 2.0 s (44.0 steps/s, 0 samples/s); per replica (2 in this process): 7 compilations "
           "(3.0 s), 1.00 device-to-host transfers per step; 0 graph(s) compiled after the first epoch in this "
           "process"),
])
def test_health_figures_are_per_replica_where_one_process_runs_several(monkeypatch, capsys, threads, expected):
    from xtrainer import _xla
    from xtrainer.callbacks import health
    from xtrainer.strategies import shared_process
    from xtrainer.strategies.launchers.cpu_threads.replicas import ThreadReplicas

    counters = {"compile_count": 0, "compile_seconds": 0.0, "execute_count": 0, "transfer_from_device_count": 0}
    for name in counters:
        monkeypatch.setattr(_xla, name, lambda name=name: counters[name])
    monkeypatch.setattr(_xla, "memory_info", lambda: None)
    clock = iter([10.0, 11.0, 12.0])
    monkeypatch.setattr(health.time, "perf_counter", lambda: next(clock))
    # What the CPU runtime's thread replicas install in their process (two threads), or the default.
    monkeypatch.setattr(shared_process, "_current", ThreadReplicas(2) if threads else shared_process.SharedProcess())
    trainer, callback = FakeTrainer(world_size=2), XlaHealth()
    callback.on_fit_start(trainer, None)
    # Two replicas in the process: 14 compilations, 176 transfers over 88 steps between them.
    counters.update(compile_count=14, compile_seconds=6.0, execute_count=176, transfer_from_device_count=176)
    trainer.global_step = 88
    logged = {}
    callback.on_metrics(trainer, None, logged, 88)
    share = 2 if threads else 1
    assert logged["xla/compilations"] == 14 / share and logged["xla/transfers_to_host"] == 176 / share
    assert logged["xla/executions"] == 176 / share and logged["throughput/steps_per_second"] == 88.0
    callback.on_fit_end(trainer, None)
    assert capsys.readouterr().out.splitlines()[0] == expected
    assert callback.totals["replicas_in_process"] == share and callback.totals["compilations"] == 14 / share
