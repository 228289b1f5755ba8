"""Bad input fails early, with a message that says what to do."""

import os
import subprocess
import sys

import conftest
import pytest
import torch
from conftest import Regressor, make_loader, subprocess_timeout
from torch import nn
from torch.utils.data import DataLoader

from xtrainer import Trainer, XDataModule, XModule, _xla
from xtrainer.callbacks import Callback


def test_unknown_strategy_lists_valid_names():
    with pytest.raises(ValueError, match="Unknown strategy 'xla_dp'. Did you mean 'xla_ddp'. Valid names: .*xla_native"):
        Trainer(strategy="xla_dp")


def test_bad_trainer_arguments():
    with pytest.raises(ValueError, match="precision"):
        Trainer(precision="64")
    with pytest.raises(ValueError, match="devices"):
        Trainer(devices=0)
    with pytest.raises(ValueError, match="gradient_clip_algorithm"):
        Trainer(gradient_clip_algorithm="l2")
    with pytest.raises(ValueError, match="limit_train_batches=1.5"):
        Trainer(limit_train_batches=1.5)
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        Trainer(accumulate_grad_batches=0)


def test_cpu_replicas_refuse_an_unverified_torch_xla(trainer_kwargs, monkeypatch):
    # Another torch_xla release cannot be installed here: pretend the version check failed.
    monkeypatch.setattr(_xla, "TESTED_TORCH_XLA", False)
    monkeypatch.setattr(_xla, "TORCH_XLA_VERSION", "2.10.0")
    with pytest.raises(RuntimeError, match="checked with torch_xla 2.9 only; this is torch_xla 2.10.0"):
        Trainer(strategy="xla_native", devices=2, **trainer_kwargs).fit(Regressor(), make_loader())


def test_launch_refuses_a_device_count_torch_xla_cannot_honour(trainer_kwargs, monkeypatch):
    # No TPU here: pretend to be a host with four TPU chips (nothing is launched).
    monkeypatch.setattr(_xla, "requested_device_type", lambda: "TPU")
    monkeypatch.setattr(_xla, "local_device_count_without_runtime", lambda: 4)
    with pytest.raises(ValueError, match="devices=2, but torch_xla.launch runs one replica on each of the 4"):
        Trainer(strategy="xla_native", devices=2, **trainer_kwargs).fit(Regressor(), make_loader())


class ReturnsNoLoss(Regressor):
    def training_step(self, batch, batch_idx):
        return {"prediction": self(batch[0])}


class ReturnsVector(Regressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self(x) - y) ** 2


class ReturnsDetached(Regressor):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx).detach()


class ForgetsToReturn(Regressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        nn.functional.mse_loss(self(x), y)


def test_a_training_step_that_never_returns_its_loss_stops_after_an_epoch_of_skips(trainer_kwargs):
    """None skips a batch, as in Lightning; None for every batch of a first epoch is a step that
    forgot `return loss`, not training: an error, not a fit that trains nothing."""
    trainer = Trainer(max_epochs=3, **trainer_kwargs)
    with pytest.warns(UserWarning, match="training_step returned None: the batch is skipped"):
        with pytest.raises(ValueError, match=r"returned None for each of the fit's first 8 batches: nothing was "
                                             r"trained.*`return loss`"):
            trainer.fit(ForgetsToReturn(), make_loader())
    assert trainer.global_step == 7  # the eighth raised before its step


@pytest.mark.parametrize("module, message", [
    (ReturnsNoLoss, "training_step returned a dict without a 'loss' tensor"),
    (ReturnsVector, r"loss of shape \(8, 1\); it must be a scalar"),
    (ReturnsDetached, "does not require grad"),
])
def test_bad_training_step_output(trainer_kwargs, module, message):
    with pytest.raises((ValueError, TypeError), match=message):
        Trainer(max_steps=1, **trainer_kwargs).fit(module(), make_loader())


def test_module_without_configure_optimizers(trainer_kwargs):
    class NoOptim(XModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).mean()

    with pytest.raises(NotImplementedError, match="no configure_optimizers"):
        Trainer(**trainer_kwargs).fit(NoOptim(), make_loader())


def test_fit_without_training_data(trainer_kwargs):
    with pytest.raises(ValueError, match="fit\\(\\) got no training data"):
        Trainer(**trainer_kwargs).fit(Regressor())


def test_fit_with_a_plain_module(trainer_kwargs):
    with pytest.raises(TypeError, match="takes an xtrainer.XModule"):
        Trainer(**trainer_kwargs).fit(torch.nn.Linear(2, 2), make_loader())


def test_misspelt_hooks_are_warned_of_and_the_run_goes_on(trainer_kwargs):
    """As in Lightning, which never calls such a method: a warning that names the hook meant."""
    class Typo(Callback):
        def on_train_epoch_ned(self, trainer, module):
            pass

    with pytest.warns(UserWarning, match="Did you mean 'on_train_epoch_end'"):
        Trainer(callbacks=[Typo()], **trainer_kwargs)

    class ModuleTypo(Regressor):
        def on_validaton_epoch_end(self):
            pass

    with pytest.warns(UserWarning, match="Did you mean 'on_validation_epoch_end'"):
        Trainer(max_epochs=1, **trainer_kwargs).fit(ModuleTypo(), make_loader())


def nan_at_sample(index):
    """The default data with one NaN input: the loss of the batch holding it is NaN."""
    loader = make_loader()
    loader.dataset.tensors[0][index, 0] = float("nan")
    return loader


def test_a_nan_loss_is_reported_with_the_step_where_it_first_happened(trainer_kwargs):
    # Sample 21 is in batch 2 of epoch 0; values are read every 50 steps (here: at the epoch's end).
    trainer = Trainer(max_epochs=3, log_every_n_steps=50, **trainer_kwargs)
    with pytest.raises(FloatingPointError, match="NaN or infinite at global step 2 .*step 8 now.* Lower the"):
        trainer.fit(Regressor(), nan_at_sample(21))
    assert trainer.global_step == 8  # found at the first read, without a host sync per step


def test_detect_nonfinite_warn_goes_on_and_off_does_not_look(trainer_kwargs):
    trainer = Trainer(max_epochs=2, log_every_n_steps=3, detect_nonfinite="warn", **trainer_kwargs)
    with pytest.warns(UserWarning, match="NaN or infinite at global step 2 .*goes on") as record:
        trainer.fit(Regressor(), nan_at_sample(21))
    assert trainer.global_step == 16 and len([w for w in record if "NaN" in str(w.message)]) == 1
    trainer = Trainer(max_epochs=1, detect_nonfinite="off", **trainer_kwargs)
    trainer.fit(Regressor(), nan_at_sample(21))
    assert trainer.global_step == 8
    with pytest.raises(ValueError, match="detect_nonfinite='skip': use 'raise', 'warn' or 'off'"):
        Trainer(detect_nonfinite="skip")


def test_log_rejects_non_scalars(trainer_kwargs):
    class LogsVector(Regressor):
        def training_step(self, batch, batch_idx):
            self.log("x", batch[0].mean(0))
            return super().training_step(batch, batch_idx)

    with pytest.raises(ValueError, match="takes a scalar"):
        Trainer(max_steps=1, **trainer_kwargs).fit(LogsVector(), make_loader())


def test_bad_optimizer_config(trainer_kwargs):
    class TwoOptims(Regressor):
        def configure_optimizers(self):
            return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.SGD(self.parameters(), lr=0.1)]

    with pytest.raises(ValueError, match="gave 2 optimizers. Several optimizers need manual optimization"):
        Trainer(max_steps=1, **trainer_kwargs).fit(TwoOptims(), make_loader())


def test_iterable_without_length_and_fractional_limit(trainer_kwargs):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(make_loader().dataset)

    loader = DataLoader(Stream(), batch_size=8)
    with pytest.raises(ValueError, match="no length"):
        Trainer(limit_train_batches=0.5, **trainer_kwargs).fit(Regressor(), loader)
    trainer, model = Trainer(max_epochs=2, **trainer_kwargs), Regressor()
    trainer.fit(model, loader)
    assert trainer.global_step == 16
    # evaluated too, batch by batch as the stream gives them (the stream is read in the loop's thread)
    plain = DataLoader(make_loader().dataset, batch_size=8)
    assert trainer.validate(model, loader, verbose=False) == trainer.validate(model, plain, verbose=False)
    predictions = trainer.predict(model, loader)
    assert len(predictions) == 8 and all(torch.equal(a, b) for a, b in zip(predictions, trainer.predict(model, plain)))


def test_several_torchrun_processes_on_the_cpu_runtime_are_refused(trainer_kwargs, monkeypatch):
    # What torchrun sets in each process it starts (no second process is needed to see it).
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="started by torchrun .* cannot run collectives across processes"):
        Trainer(strategy="xla_native", **trainer_kwargs).fit(Regressor(), make_loader())


@pytest.mark.multi_device
def test_a_script_that_trains_at_import_is_told_to_guard_it(tmp_path):
    """The replicas' process imports the script again; training at import time starts there too."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {os.path.dirname(conftest.__file__)!r})\n"
        "from conftest import Regressor, make_loader\n"
        "from xtrainer import Trainer\n"
        "Trainer(devices=2, max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,\n"
        f"        default_root_dir={str(tmp_path)!r}).fit(Regressor(), make_loader())\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=subprocess_timeout(600),
                          env={**os.environ, "PJRT_DEVICE": "CPU"}, cwd=tmp_path)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: The script starts training when it is imported")
    assert "if __name__ == '__main__':" in last


class FailsAtStep2(Regressor):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            raise ValueError("the module's own error at batch 2")
        return super().training_step(batch, batch_idx)


class BrokenCleanup(Callback):
    """A callback whose ``on_exception`` and ``teardown`` fail too."""

    def on_exception(self, trainer, module, exception):
        raise RuntimeError("on_exception broke")

    def teardown(self, trainer, module, stage):
        raise OSError("teardown broke")


class BrokenData(XDataModule):
    """A data module whose teardown (in the calling process) fails."""

    def train_dataloader(self):
        return make_loader()

    def teardown(self, stage):
        raise OSError("the data module's teardown broke")


@pytest.mark.parametrize("strategy, devices", [
    ("auto", 1), pytest.param("xla_ddp", 2, marks=pytest.mark.multi_device),  # thread replicas
    pytest.param("native_ddp", 2, marks=pytest.mark.multi_device)])  # real processes
def test_a_failing_teardown_or_on_exception_does_not_hide_the_replicas_error(trainer_kwargs, strategy, devices):
    trainer = Trainer(strategy=strategy, max_epochs=1, devices=devices, callbacks=[BrokenCleanup()], **trainer_kwargs)
    with pytest.raises(ValueError, match="the module's own error at batch 2") as info:
        trainer.fit(FailsAtStep2(), make_loader())
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "BrokenCleanup.on_exception failed too: RuntimeError: on_exception broke" in notes and "BrokenCleanup.teardown" in notes and "teardown broke" in notes
    assert trainer.state == "idle"

    trainer = Trainer(strategy=strategy, max_epochs=1, devices=devices, **trainer_kwargs)
    with pytest.raises(ValueError, match="the module's own error at batch 2") as info:
        trainer.fit(FailsAtStep2(), datamodule=BrokenData())
    assert "the data module's teardown broke" in "\n".join(getattr(info.value, "__notes__", []))
    # Without an error of the run, a failing teardown is the error.
    trainer = Trainer(strategy=strategy, max_epochs=1, devices=devices, callbacks=[BrokenCleanup()], **trainer_kwargs)
    with pytest.raises(OSError, match="teardown broke"):
        trainer.fit(Regressor(), make_loader())
