"""Lightning's ModelCheckpoint, EarlyStopping and LearningRateMonitor, used as a Lightning user does:
file names on disk, the best checkpoints across a resume, the epoch a fit stops at, the logged keys."""

import math
import os

import pytest
import torch
from conftest import Regressor, make_loader

from xtrainer import Trainer, _xla
from xtrainer.callbacks import Callback, EarlyStopping, LearningRateMonitor, MetricNotFoundError, ModelCheckpoint
from xtrainer.checkpoint import CheckpointError, load_checkpoint
from xtrainer.loggers import Logger


class Scripted(Regressor):
    """Logs ``name`` = ``scores[i]`` at the end of its i-th validation (the sanity check's aside)."""

    def __init__(self, scores, name="val_loss", **kwargs):
        super().__init__(**kwargs)
        self.scores, self.name, self.validations = scores, name, 0

    def validation_step(self, batch, batch_idx):
        pass

    def on_validation_epoch_end(self):
        if getattr(self.trainer, "sanity_checking", False):
            return
        self.log(self.name, float(self.scores[self.validations]))
        self.validations += 1


class Recording(Logger):
    """Keeps what reaches the loggers: ``(step, metrics)``."""

    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step):
        self.rows.append((step, dict(metrics)))


def fit(root, callbacks=(), epochs=3, module=None, val=True, ckpt_path=None, **kwargs):
    """A tiny fit: 2 steps per epoch, validation on 8 samples."""
    kwargs = {"logger": False, "enable_checkpointing": any(isinstance(cb, ModelCheckpoint) for cb in callbacks),
              "enable_xla_health": False, **kwargs}
    trainer = Trainer(max_epochs=epochs, default_root_dir=str(root), enable_progress_bar=False,
                      callbacks=list(callbacks), **kwargs)
    trainer.fit(module if module is not None else Regressor(), make_loader(n=16),
                make_loader(n=8, seed=1) if val else None, ckpt_path=ckpt_path)
    return trainer


def ckpts(folder):
    """Every checkpoint under ``folder``, relative names, sorted (subfolders too)."""
    found = []
    for top, _, files in os.walk(folder):
        found += [os.path.relpath(os.path.join(top, f), folder) for f in files if not f.startswith(".")]
    return sorted(found)


# ---- ModelCheckpoint: names -----------------------------------------------------------------------
def test_file_names_are_lightnings(tmp_path):
    scores = [0.5, 0.08, 0.3]
    named = ModelCheckpoint(dirpath=tmp_path / "a", monitor="val_loss", filename="{epoch}-{val_loss:.2f}",
                            save_top_k=-1, save_last=False)
    raw = ModelCheckpoint(dirpath=tmp_path / "b", monitor="val_loss", filename="e{epoch:02d}_{val_loss:.3f}",
                          auto_insert_metric_name=False, save_top_k=1, save_last=False)
    default = ModelCheckpoint(dirpath=tmp_path / "c", save_last=False)
    fit(tmp_path, [named, raw, default], module=Scripted(scores))
    assert ckpts(tmp_path / "a") == ["epoch=0-val_loss=0.50.ckpt", "epoch=1-val_loss=0.08.ckpt",
                                     "epoch=2-val_loss=0.30.ckpt"]
    assert ckpts(tmp_path / "b") == ["e01_0.080.ckpt"]
    assert ckpts(tmp_path / "c") == ["epoch=2-step=6.ckpt"]  # Lightning's default: the newest, "{epoch}-{step}"
    assert named.best_model_path == os.path.join(named.dirpath, "epoch=1-val_loss=0.08.ckpt")
    assert isinstance(named.best_model_score, torch.Tensor) and named.best_model_score.item() == pytest.approx(0.08)
    assert default.best_model_score is None and default.best_k_models == {}  # as Lightning, without a monitor
    # every checkpoint kept: the kth is the worst of them, as in Lightning
    assert named.kth_best_model_path == os.path.join(named.dirpath, "epoch=0-val_loss=0.50.ckpt")
    assert named.kth_value.item() == pytest.approx(0.5)

    cb = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}-{val_loss:.2f}")
    name = cb.format_checkpoint_name({"epoch": 2, "val_loss": 0.123456})
    assert os.path.basename(name) == "epoch=2-val_loss=0.12.ckpt"
    assert os.path.basename(cb.format_checkpoint_name({}, filename="{missing:d}")) == "missing=0.ckpt"
    assert os.path.basename(cb.format_checkpoint_name({"epoch": 5}, filename="{epoch:03d}", ver=1)) == \
        "epoch=005-v1.ckpt"


def test_a_metric_named_with_a_slash(tmp_path):
    # Lightning writes "epoch=0-val/loss=0.50.ckpt": a subfolder. Pruned ones go, with their empty folders.
    nested = ModelCheckpoint(dirpath=tmp_path / "nested", monitor="val/loss", filename="{epoch}-{val/loss:.2f}")
    flat = ModelCheckpoint(dirpath=tmp_path / "flat", monitor="val/loss", filename="{epoch}-val_loss={val/loss:.2f}",
                           auto_insert_metric_name=False)
    alias = ModelCheckpoint(dirpath=tmp_path / "alias", monitor="val/loss", filename="{val_loss:.2f}")
    fit(tmp_path, [nested, flat, alias], module=Scripted([0.5, 0.4, 0.3], name="val/loss"))
    assert ckpts(tmp_path / "nested") == ["epoch=2-val/loss=0.30.ckpt", "last.ckpt"]
    assert sorted(os.listdir(tmp_path / "nested")) == ["epoch=2-val", "last.ckpt"]  # epoch=0-val/, epoch=1-val/ went
    assert os.readlink(tmp_path / "nested" / "last.ckpt") == "epoch=2-val/loss=0.30.ckpt"
    assert load_checkpoint(nested.last_model_path)["loops"]["epoch"] == 2
    assert ckpts(tmp_path / "flat") == ["2-val_loss=0.30.ckpt", "last.ckpt"]
    assert ckpts(tmp_path / "alias") == ["last.ckpt", "val_loss=0.30.ckpt"]


def test_hostile_file_names_are_refused_at_once(tmp_path):
    for filename, match in [("/tmp/{epoch}", "outside dirpath"), ("../{epoch}", "outside dirpath"),
                            (".{epoch}", "start with '.'"), ("{epoch", "not a format string"),
                            ("{epoch}-{}", "empty field"), ("last", "name of the last checkpoint"),
                            ("{val_loss:.2q}", "not a format string"), ("sub/", "must not be empty")]:
        with pytest.raises(ValueError, match=match):
            ModelCheckpoint(dirpath=tmp_path, filename=filename)


def test_version_counter_for_names_that_repeat(tmp_path):
    # 0.31 and 0.34 both print as 0.3: the second is kept as -v1 (Lightning), or replaces the first.
    counted = ModelCheckpoint(dirpath=tmp_path / "v", monitor="val_loss", filename="{val_loss:.1f}", save_top_k=-1,
                              save_last=False)
    replaced = ModelCheckpoint(dirpath=tmp_path / "r", monitor="val_loss", filename="{val_loss:.1f}", save_top_k=-1,
                               save_last=False, enable_version_counter=False)
    fit(tmp_path, [counted, replaced], epochs=2, module=Scripted([0.31, 0.34]))
    assert ckpts(tmp_path / "v") == ["val_loss=0.3-v1.ckpt", "val_loss=0.3.ckpt"]
    assert ckpts(tmp_path / "r") == ["val_loss=0.3.ckpt"]
    assert load_checkpoint(tmp_path / "r" / "val_loss=0.3.ckpt")["loops"]["epoch"] == 1


# ---- ModelCheckpoint: what is kept ----------------------------------------------------------------
def test_top_k_with_ties_nan_and_the_last_checkpoint(tmp_path):
    scores = [0.5, math.nan, 0.3, 0.3, 0.4, 0.1]
    top2 = ModelCheckpoint(dirpath=tmp_path / "top2", monitor="val_loss", filename="{epoch}", save_top_k=2)
    best_max = ModelCheckpoint(dirpath=tmp_path / "max", monitor="val_loss", filename="{epoch}", mode="max",
                               save_last="link")
    none = ModelCheckpoint(dirpath=tmp_path / "none", monitor="val_loss", save_top_k=0)
    fit(tmp_path, [top2, best_max, none], epochs=6, module=Scripted(scores))
    # NaN entered while there was room (as inf, the worst), and went first; of the two 0.3s the first stays
    # the k-th best, so a tie does not enter and the better 0.1 replaces the older 0.3.
    assert ckpts(tmp_path / "top2") == ["epoch=3.ckpt", "epoch=5.ckpt", "last.ckpt"]
    assert {os.path.basename(p): round(s.item(), 4) for p, s in top2.best_k_models.items()} == {
        "epoch=3.ckpt": 0.3, "epoch=5.ckpt": 0.1}
    assert top2.best_model_path.endswith("epoch=5.ckpt") and top2.kth_best_model_path.endswith("epoch=3.ckpt")
    assert top2.last_model_path == os.path.join(top2.dirpath, "last.ckpt") and os.path.islink(top2.last_model_path)
    # mode="max", save_last="link": the best is 0.5; the newest lives under its own name for last.ckpt's link
    assert ckpts(tmp_path / "max") == ["epoch=0.ckpt", "epoch=5.ckpt", "last.ckpt"]
    assert os.readlink(tmp_path / "max" / "last.ckpt") == "epoch=5.ckpt"
    # save_top_k=0 with save_last: last.ckpt alone, a complete file of the newest state
    assert ckpts(tmp_path / "none") == ["last.ckpt"] and not os.path.islink(tmp_path / "none" / "last.ckpt")
    assert load_checkpoint(tmp_path / "none" / "last.ckpt")["loops"]["epoch"] == 5
    assert none.best_model_path == "" and none.best_k_models == {}


def test_a_custom_last_name_and_folder_checkpoints(tmp_path):
    # CHECKPOINT_NAME_LAST with fields, as Lightning documents: the previous one goes
    saver = ModelCheckpoint(dirpath=tmp_path / "named")
    saver.CHECKPOINT_NAME_LAST = "{epoch}-last"
    fit(tmp_path, [saver], epochs=3)
    assert ckpts(saver.dirpath) == ["epoch=2-last.ckpt", "epoch=2-step=6.ckpt"]
    # an FSDP checkpoint is a folder: last.ckpt switches between a link and a folder of its own
    sharded = ModelCheckpoint(dirpath=tmp_path / "fsdp", monitor="val_loss", filename="{epoch}")
    fit(tmp_path, [sharded], epochs=4, module=Scripted([0.5, 0.6, 0.4, 0.7]), strategy="xla_fsdp")
    names = sorted(os.listdir(sharded.dirpath))
    assert names == ["epoch=2.ckpt", "last.ckpt"]  # no leftovers of the switches
    last = os.path.join(sharded.dirpath, "last.ckpt")
    assert os.path.isdir(last) and not os.path.islink(last)
    assert torch.load(os.path.join(last, "trainer.pt"), weights_only=True)["loops"]["epoch"] == 3


def test_every_n_epochs_and_where_epochs_end(tmp_path):
    every2 = ModelCheckpoint(dirpath=tmp_path / "e2", every_n_epochs=2, save_top_k=-1, save_last=False,
                             save_on_train_epoch_end=True)
    auto = ModelCheckpoint(dirpath=tmp_path / "auto", monitor="val_loss", save_top_k=-1, save_last=False)
    fit(tmp_path, [every2, auto], epochs=4, module=Scripted([4, 3, 2, 1, 0, -1, -2, -3]),
        val_check_interval=1)  # a validation after every step: 2 per epoch
    assert ckpts(tmp_path / "e2") == ["epoch=1-step=4.ckpt", "epoch=3-step=8.ckpt"]
    # several validations per epoch: Lightning saves after each one (save_on_train_epoch_end=None)
    assert ckpts(tmp_path / "auto") == [f"epoch={(s - 1) // 2}-step={s}.ckpt" for s in range(1, 9)]


def test_monitor_waits_for_the_first_validation(tmp_path):
    # A validation metric does not exist before the first validation: no KeyError, a warning, no top-k
    # checkpoint until it is logged (last.ckpt is written all the same), as in Lightning.
    steps = ModelCheckpoint(dirpath=tmp_path / "steps", monitor="val_loss", every_n_train_steps=1, save_top_k=2)
    epochs = ModelCheckpoint(dirpath=tmp_path / "epochs", monitor="val_loss")
    with pytest.warns(UserWarning, match=r"monitor='val_loss'\) found no such logged metric. Logged: \["):
        fit(tmp_path, [steps, epochs], epochs=3, module=Scripted([0.5]), check_val_every_n_epoch=2)
    assert ckpts(tmp_path / "steps") == ["epoch=2-step=5.ckpt", "epoch=2-step=6.ckpt", "last.ckpt"]
    assert ckpts(tmp_path / "epochs") == ["epoch=1-step=4.ckpt", "last.ckpt"]  # saved after the validation


def test_a_metric_never_logged(tmp_path):
    # after a validation that did not log it: an error naming what was logged (Lightning raises too)
    with pytest.raises(MetricNotFoundError, match=r"monitor='val_acc'\) found no such logged metric\. Logged: .*val_"):
        fit(tmp_path / "a", [ModelCheckpoint(monitor="val_acc")], epochs=1, module=Scripted([0.5]))
    # no validation at all: only the warning, every epoch's last.ckpt still written
    saver = ModelCheckpoint(monitor="val_acc")
    with pytest.warns(UserWarning, match="val_acc"):
        fit(tmp_path / "b", [saver], epochs=2, val=False)
    assert ckpts(saver.dirpath) == ["last.ckpt"] and saver.best_model_path == ""


def test_the_best_checkpoints_survive_a_resume(tmp_path):
    class Seen(Callback):
        def on_train_start(self, trainer, module):
            saver = next(cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint))
            self.restored = (saver.best_model_path, saver.best_model_score, dict(saver.best_k_models),
                             saver.kth_best_model_path, saver.last_model_path)

    scores = [0.5, 0.2, 0.4, 0.1, 0.3, 0.6, 0.05, 0.7]
    first = ModelCheckpoint(monitor="val_loss", save_top_k=2, filename="{epoch}-{val_loss:.1f}")
    fit(tmp_path, [first], epochs=3, module=Scripted(scores))
    before = (first.best_model_path, first.best_model_score, dict(first.best_k_models), first.kth_best_model_path,
              first.last_model_path)
    seen = Seen()
    again = ModelCheckpoint(monitor="val_loss", save_top_k=2, filename="{epoch}-{val_loss:.1f}",
                            dirpath=first.dirpath)
    module = Scripted(scores)
    module.validations = 3
    fit(tmp_path, [again, seen], epochs=6, module=module, ckpt_path="last")
    assert seen.restored == before  # all of Lightning's attributes came back from the checkpoint
    assert ckpts(first.dirpath) == ["epoch=1-val_loss=0.2.ckpt", "epoch=3-val_loss=0.1.ckpt", "last.ckpt"]
    assert again.best_model_path.endswith("epoch=3-val_loss=0.1.ckpt") and again.best_model_score.item() == \
        pytest.approx(0.1)
    assert load_checkpoint(again.last_model_path)["loops"]["epoch"] == 5

    # resumed with a smaller save_top_k: the restored list shrinks to it at the next checkpoint kept
    fewer = ModelCheckpoint(monitor="val_loss", save_top_k=1, filename="{epoch}-{val_loss:.1f}", dirpath=first.dirpath)
    module = Scripted(scores)
    module.validations = 6
    fit(tmp_path, [fewer], epochs=7, module=module, ckpt_path="last")
    assert ckpts(first.dirpath) == ["epoch=6-val_loss=0.1.ckpt", "last.ckpt"]

    # resumed with another monitor: a warning; this callback starts afresh and never removes those files
    other = ModelCheckpoint(monitor="train_loss_epoch", dirpath=first.dirpath, filename="t{epoch}")
    with pytest.warns(UserWarning, match="holds the bookkeeping of ModelCheckpoint.monitor='val_loss'"):
        fit(tmp_path, [other], epochs=8, module=Scripted(scores), ckpt_path="last")
    assert ckpts(first.dirpath) == ["epoch=6-val_loss=0.1.ckpt", "last.ckpt", "tepoch=7.ckpt"]


def test_a_value_logged_per_step_and_per_epoch_is_monitored_by_its_plain_name(tmp_path):
    """Lightning puts ``x`` beside ``x_step`` and ``x_epoch`` in ``callback_metrics`` (the epoch's
    value at an epoch's end), so a ported project's ``monitor="train_loss"`` finds it."""
    saver = ModelCheckpoint(monitor="train_loss", filename="{epoch}-{train_loss:.4f}", save_top_k=1)
    stopper = EarlyStopping(monitor="train_loss", patience=10)
    trainer = fit(tmp_path, [saver, stopper], epochs=3)
    epoch_value = trainer.callback_metrics["train_loss_epoch"]
    assert trainer.callback_metrics["train_loss"] == epoch_value
    assert saver.best_model_score is not None and stopper.best_score is not None
    assert os.path.basename(saver.best_model_path).startswith("epoch=")
    assert "train_loss" not in trainer.logged_metrics  # loggers keep Lightning's suffixed names


class SaveNowAt(Callback):
    """Calls ``save_now`` (what a SIGTERM does) after step 3."""

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == 3:
            self.path = trainer.checkpoint_callback.save_now(trainer)


def test_save_weights_only(tmp_path):
    saver, stop = ModelCheckpoint(save_weights_only=True, save_top_k=-1), SaveNowAt()
    trainer = fit(tmp_path, [saver, stop], epochs=2)
    ckpt = load_checkpoint(saver.best_model_path)
    assert ckpt["weights_only"] is True and ckpt["optimizer_states"] == [] and ckpt["callbacks"] == {}
    assert "rng_states" not in ckpt and ckpt["loops"]["global_step"] == 4
    # the checkpoint written on a signal is complete all the same: it is the one to resume from
    assert stop.path == saver.last_model_path
    full = load_checkpoint(os.path.join(saver.dirpath, "epoch=1-step=3.ckpt"))
    assert "weights_only" not in full and len(full["optimizer_states"]) == 1 and full["callbacks"]
    # its weights load (validate with ckpt_path, load_from_checkpoint), ...
    model = Regressor(lr=123.0)
    trainer.validate(model, make_loader(n=8, seed=1), ckpt_path=saver.best_model_path)
    loaded = Regressor.load_from_checkpoint(saver.best_model_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, ckpt["state_dict"][name]) and torch.equal(loaded.state_dict()[name], tensor)
    # ... but a fit cannot continue from it, and says why
    with pytest.raises(CheckpointError, match="weights only"):
        fit(tmp_path, [ModelCheckpoint()], epochs=3, ckpt_path=saver.best_model_path)


def test_verbose_says_one_line_per_save(tmp_path, capsys):
    saver = ModelCheckpoint(monitor="val_loss", verbose=True, filename="{epoch}")
    fit(tmp_path, [saver], epochs=3, module=Scripted([0.5, 0.6, 0.4]))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Epoch ")]
    path = os.path.join(saver.dirpath, "{}").format
    assert lines == [
        f"Epoch 0, global step 2: 'val_loss' reached 0.50000 (best 0.50000), saving model to {path('epoch=0.ckpt')!r} "
        "as top 1",
        "Epoch 1, global step 4: 'val_loss' was not in top 1",
        f"Epoch 1, global step 4: saving the last checkpoint to {path('last.ckpt')!r}",
        f"Epoch 2, global step 6: 'val_loss' reached 0.40000 (best 0.40000), saving model to {path('epoch=2.ckpt')!r} "
        "as top 1"]


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(TypeError, match="save_top_K"):
        ModelCheckpoint(save_top_K=2)
    with pytest.raises(ValueError, match="every_n_train_steps=2, every_n_epochs=1\\): give only one"):
        ModelCheckpoint(every_n_train_steps=2, every_n_epochs=1)
    with pytest.raises(ValueError, match="save_top_k=-2"):
        ModelCheckpoint(save_top_k=-2)
    with pytest.raises(ValueError, match="save_last='copy'"):
        ModelCheckpoint(save_last="copy")
    with pytest.raises(ValueError, match="mode='best'"):
        ModelCheckpoint(monitor="x", mode="best")
    with pytest.raises(TypeError, match="patiense"):
        EarlyStopping("x", patiense=3)
    with pytest.raises(ValueError, match="logging_interval='batch'"):
        LearningRateMonitor(logging_interval="batch")
    with pytest.raises(TypeError, match="log_lr"):
        LearningRateMonitor(log_lr=True)


# ---- EarlyStopping ----------------------------------------------------------------------------
def test_early_stopping_lightning_arguments(tmp_path, capsys):
    # positional as in Lightning: monitor, min_delta, patience, verbose, mode
    stopper = EarlyStopping("val_loss", 0.0, 2, True, "min")
    trainer = fit(tmp_path / "p", [stopper], epochs=10, module=Scripted([5, 4, 4.5, 4.2, 3, 2]))
    assert trainer.current_epoch == 4 and stopper.stopped_epoch == 3 and stopper.wait_count == 2
    assert isinstance(stopper.best_score, torch.Tensor) and stopper.best_score.item() == 4
    out = capsys.readouterr().out
    assert "Metric val_loss improved by 1.000 >= min_delta = 0.0. New best score: 4.000" in out
    assert "Monitored metric val_loss did not improve in the last 2 records. Best score: 4.000." in out

    diverged = EarlyStopping("val_loss", patience=100, divergence_threshold=10.0)
    assert fit(tmp_path / "d", [diverged], epochs=10, module=Scripted([5, 8, 11, 2])).current_epoch == 3
    assert diverged.stop_reason.startswith("Divergence threshold reached: val_loss = 11.0 > 10.0")
    reached = EarlyStopping("val_loss", patience=100, stopping_threshold=1.0)
    assert fit(tmp_path / "t", [reached], epochs=10, module=Scripted([5, 1.0, 0.9, 0.1])).current_epoch == 3
    nan = EarlyStopping("val_loss", patience=100, check_finite=False)  # NaN: not an improvement, not a stop
    assert fit(tmp_path / "n", [nan], epochs=3, module=Scripted([5, math.nan, 4])).current_epoch == 3
    assert nan.wait_count == 0 and nan.best_score.item() == 4 and nan.stopped_epoch == 0


def test_early_stopping_strict_and_where_it_checks(tmp_path):
    with pytest.raises(RuntimeError, match=r"EarlyStopping\(monitor='val_acc'\).* Logged: .*val_loss"):
        fit(tmp_path / "s", [EarlyStopping("val_acc")], epochs=2, module=Scripted([1, 2]))
    lenient = EarlyStopping("val_acc", strict=False)
    with pytest.warns(RuntimeWarning, match="val_acc.*check is skipped"):
        assert fit(tmp_path / "l", [lenient], epochs=2, module=Scripted([1, 2])).current_epoch == 2
    # two validations per epoch: checked after each one (patience counts validations), as in Lightning
    per_val = EarlyStopping("val_loss", patience=2)
    trainer = fit(tmp_path / "v", [per_val], epochs=10, module=Scripted([3, 2, 2, 2, 1]), val_check_interval=1)
    assert trainer.current_epoch == 2 and trainer.global_step == 4 and per_val.stopped_epoch == 1
    at_end = EarlyStopping("val_loss", patience=2, check_on_train_epoch_end=True)  # after each epoch's last one
    trainer = fit(tmp_path / "e", [at_end], epochs=10, module=Scripted([3, 2, 2, 1, 2, 1, 2, 1, 2]),
                  val_check_interval=1)
    assert trainer.current_epoch == 4 and at_end.wait_count == 2  # per validation it would have stopped in epoch 2

    class AtTrainEnd(EarlyStopping):  # Lightning's documented way to check elsewhere
        def on_validation_end(self, trainer, module):
            pass

        def on_train_epoch_end(self, trainer, module):
            pass

        def on_train_end(self, trainer, module):
            self._run_early_stopping_check(trainer)

    moved = AtTrainEnd("val_loss", patience=1)
    assert fit(tmp_path / "m", [moved], epochs=3, module=Scripted([3, 2, 1])).current_epoch == 3
    assert moved.best_score.item() == 1 and moved.wait_count == 0


def test_evaluating_last_after_a_fit_that_kept_only_an_older_best_uses_the_trained_weights(tmp_path):
    """Lightning's ``ckpt_path="last"`` is a ``last.ckpt``; with none, it evaluates the module as
    it is (with a warning), not the one checkpoint kept, the best of an earlier epoch."""
    best_first = ModelCheckpoint(dirpath=tmp_path / "c", monitor="val_loss", save_top_k=1, save_last=False)
    module = Scripted([0.1, 0.5, 0.9, 0.7])
    trainer = fit(tmp_path, [best_first], module=module, epochs=3)
    assert ckpts(tmp_path / "c") == ["epoch=0-step=2.ckpt"] and trainer.global_step == 6
    trained = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.warns(UserWarning, match=r"validate\(ckpt_path='last'\): the newest checkpoint .* is older"):
        trainer.validate(module, make_loader(n=8, seed=1), ckpt_path="last", verbose=False)
    assert trainer.ckpt_path is None
    assert all(torch.equal(trained[k], v) for k, v in module.state_dict().items())  # not epoch 0's weights
    # with a last.ckpt, that one
    saver = ModelCheckpoint(dirpath=tmp_path / "l", monitor="val_loss", save_top_k=1, save_last=True)
    module = Scripted([0.1, 0.5, 0.9, 0.7])
    trainer = fit(tmp_path / "second", [saver], module=module, epochs=3)
    trainer.validate(module, make_loader(n=8, seed=1), ckpt_path="last", verbose=False)
    assert trainer.ckpt_path is not None and trainer.ckpt_path.startswith(str(tmp_path / "l"))


# ---- LearningRateMonitor --------------------------------------------------------------------------
class TwoGroups(Regressor):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD([{"params": self.net[0].parameters()},
                                     {"params": self.net[2].parameters(), "lr": 0.01}], lr=0.05, momentum=0.9)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)}


def test_learning_rates_under_lightnings_names(tmp_path):
    every_step = Recording()
    fit(tmp_path / "a", [LearningRateMonitor()], epochs=2, module=Regressor(optimizer="adam", lr=0.01),
        logger=every_step, log_every_n_steps=1)
    keyed = [(step, m["lr-Adam"]) for step, m in every_step.rows if "lr-Adam" in m]
    # at each logging step, and, without a scheduler, at each epoch's start too (steps 0 and 2, as
    # Lightning logs them: a batch's at the steps before it), never the automatic key
    assert [step for step, _ in keyed] == [0, 0, 1, 2, 2, 3] and {lr for _, lr in keyed} == {0.01}
    assert not any(key.startswith("lr-Adam/") for _, m in every_step.rows for key in m)

    logger, monitor = Recording(), LearningRateMonitor(log_momentum=True, log_weight_decay=True)
    trainer = fit(tmp_path / "b", [monitor], epochs=3, module=TwoGroups(), logger=logger, log_every_n_steps=1)
    logged = [m for _, m in logger.rows if "lr-SGD/pg1" in m]
    # an epoch scheduler: the rate of each epoch, once, as it starts; pg1 and pg2 are the two groups
    assert [m["lr-SGD/pg1"] for m in logged] == pytest.approx([0.05, 0.025, 0.0125])
    assert [m["lr-SGD/pg2"] for m in logged] == pytest.approx([0.01, 0.005, 0.0025])
    assert all(m["lr-SGD/pg1-momentum"] == 0.9 and m["lr-SGD/pg2-weight_decay"] == 0 for m in logged)
    assert monitor.lrs == {"lr-SGD/pg1": pytest.approx([0.05, 0.025, 0.0125]),
                           "lr-SGD/pg2": pytest.approx([0.01, 0.005, 0.0025])}
    assert trainer.callback_metrics["lr-SGD/pg2"] == pytest.approx(0.0025)  # monitorable, as in Lightning

    with pytest.raises(ValueError, match="needs a Trainer with a logger"):
        fit(tmp_path / "c", [LearningRateMonitor()], epochs=1)


class LogsNothing(Regressor):
    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        pass


def test_per_step_learning_rates_reach_the_loggers_when_the_module_logs_nothing(tmp_path):
    """A logging step where the module logged nothing still gives the callbacks their turn: the
    monitor's rates are written alone (no row at all without it), as in Lightning."""
    logger = Recording()
    fit(tmp_path / "a", [LearningRateMonitor(logging_interval="step")], epochs=2, module=LogsNothing(),
        logger=logger, log_every_n_steps=1)
    assert [(step, m) for step, m in logger.rows] == [(step, {"lr-SGD": 0.05}) for step in (0, 1, 2, 3)]
    quiet = Recording()
    fit(tmp_path / "b", [], epochs=2, module=LogsNothing(), logger=quiet, log_every_n_steps=1)
    assert quiet.rows == []


def test_learning_rate_monitor_adds_no_device_reads(tmp_path):
    class Transfers(Callback):
        def __init__(self):
            self.at = []

        def on_train_epoch_start(self, trainer, module):
            _xla.wait_device_ops()
            self.at.append(_xla.transfer_from_device_count())

    def per_epoch(callbacks):
        counter = Transfers()
        fit(tmp_path, [counter, *callbacks], epochs=3, logger=Recording(), log_every_n_steps=1,
            module=Regressor(optimizer="adam", lr=0.01))
        return [b - a for a, b in zip(counter.at, counter.at[1:])]

    assert per_epoch([LearningRateMonitor(logging_interval="step", log_momentum=True)]) == per_epoch([])


class RankScores(Regressor):
    def validation_step(self, batch, batch_idx):
        pass

    def on_validation_epoch_end(self):  # not synced: better every epoch on rank 0, worse on rank 1
        epoch = float(self.current_epoch)
        self.log("score", epoch if self.trainer.global_rank == 0 else -epoch)


@pytest.mark.multi_device
def test_replicas_that_disagree_on_the_metric_follow_rank_zero(tmp_path):
    saver = ModelCheckpoint(monitor="score", mode="max", save_top_k=2, filename="{epoch}")
    trainer = Trainer(devices=2, max_epochs=3, default_root_dir=str(tmp_path), enable_progress_bar=False,
                      logger=False, enable_xla_health=False, callbacks=[saver])
    trainer.fit(RankScores(), make_loader(n=16, batch_size=4), make_loader(n=8, seed=1, batch_size=4))
    # rank 1 alone would have kept epochs 0 and 1 and skipped the last save, which is collective
    assert ckpts(saver.dirpath) == ["epoch=1.ckpt", "epoch=2.ckpt", "last.ckpt"]
    assert saver.best_model_path.endswith("epoch=2.ckpt") and saver.best_model_score.item() == 2
