"""An exception raised while loading data (a dataset's ``__getitem__``, a ``collate_fn``, a sampler)
reaches the caller as itself, in any epoch, for every loader, with one replica or several; the run
is not reported as finished."""

import os
import subprocess
import sys

import conftest
import pytest
from conftest import Regressor, make_data, make_loader, subprocess_timeout
from failing_data import DataError, FailingCollate, FailingDataset, FailingSampler
from torch.utils.data import DataLoader

from xtrainer import Trainer
from xtrainer.strategies.launchers import ReplicaFailure

TESTS = os.path.dirname(os.path.abspath(conftest.__file__))


def finished(out):
    """Whether ``out`` holds the line XlaHealth prints when a fit ends normally."""
    return any(line.startswith("fit: ") for line in out.splitlines())


def failing_loader(fail_at=20, from_read=0, n=64, seed=0):
    return DataLoader(FailingDataset(n, seed, fail_at, from_read), batch_size=8)


def note(err):
    return "\n".join(getattr(err, "__notes__", []))


def raised_in(err, filename="failing_data.py"):
    """Whether ``err``'s traceback goes through ``filename`` (where the data objects raise)."""
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(filename):
            return True
        tb = tb.tb_next
    return False


@pytest.mark.parametrize("loader, steps, batch", [
    (lambda: failing_loader(fail_at=0), 0, 0),  # the first batch
    (lambda: failing_loader(fail_at=20), 2, 2),  # mid-epoch
    (lambda: failing_loader(fail_at=20, from_read=64), 8 + 2, 2),  # the second epoch
    (lambda: DataLoader(make_data(), batch_size=8, collate_fn=FailingCollate(fail_on=3)), 3, 3),
    (lambda: DataLoader(make_data(), batch_size=8, sampler=FailingSampler(64, fail_at=40)), 5, 5),
    (lambda: DataLoader(make_data(), batch_sampler=FailingSampler(8, fail_at=None)), 0, 0),
], ids=["first-batch", "mid-epoch", "later-epoch", "collate_fn", "sampler", "batch-sampler-iter"])
def test_a_training_data_error_reaches_fit(trainer_kwargs, capsys, loader, steps, batch):
    trainer = Trainer(max_epochs=2, **trainer_kwargs)
    with pytest.raises(DataError) as info:
        trainer.fit(Regressor(), loader())
    assert raised_in(info.value)
    assert f"(raised while loading batch index {batch} of DataLoader over " in note(info.value)
    assert trainer.global_step == steps  # the batches before the failing one were trained on
    assert not finished(capsys.readouterr().out)


@pytest.mark.parametrize("strategy", ["xla_native", "xla_ddp", "xla_fsdp"])
def test_every_strategy_with_one_device(trainer_kwargs, capsys, strategy):
    trainer = Trainer(strategy=strategy, devices=1, max_epochs=1, **trainer_kwargs)
    with pytest.raises(DataError, match="sample 20 cannot be read") as info:
        trainer.fit(Regressor(), failing_loader())
    assert raised_in(info.value)
    assert note(info.value) == ("(raised while loading batch index 2 of DataLoader over FailingDataset; "
                                "the batches before it were used)")
    assert not finished(capsys.readouterr().out)


def test_a_validation_error_during_fit(trainer_kwargs, capsys):
    trainer = Trainer(max_epochs=2, num_sanity_val_steps=0, **trainer_kwargs)
    with pytest.raises(DataError) as info:  # the second validation pass reads sample 9 again
        trainer.fit(Regressor(), make_loader(), failing_loader(fail_at=9, from_read=16, n=16, seed=1))
    assert "batch index 1 of DataLoader over FailingDataset" in note(info.value)
    assert trainer.current_epoch == 1 and trainer.global_step == 16
    assert not finished(capsys.readouterr().out)


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_evaluation_loaders(trainer_kwargs, stage):
    trainer = Trainer(**trainer_kwargs)
    with pytest.raises(DataError) as info:
        getattr(trainer, stage)(Regressor(), failing_loader(fail_at=12, n=16))
    assert raised_in(info.value)
    assert "batch index 1 of DataLoader over FailingDataset" in note(info.value)


def test_an_error_after_the_batch_limit_is_not_raised(trainer_kwargs, capsys):
    """Batches past ``limit_train_batches`` may be read ahead in the background; they are not part
    of the run, and neither is their error."""
    trainer = Trainer(max_epochs=2, limit_train_batches=2, **trainer_kwargs)
    trainer.fit(Regressor(), failing_loader(fail_at=40))
    assert trainer.global_step == 4 and finished(capsys.readouterr().out)


@pytest.mark.multi_device
@pytest.mark.parametrize("strategy", ["xla_native", "xla_ddp", "xla_fsdp"])
def test_one_failing_replica_stops_the_others(tmp_path, strategy):
    # The replicas' samplers deal indices in turn: sample 20 is replica 0's, in its second batch.
    trainer = Trainer(strategy=strategy, devices=2, max_epochs=2, default_root_dir=str(tmp_path),
                      enable_progress_bar=False, logger=False, enable_checkpointing=False)
    with pytest.raises(DataError, match="sample 20 cannot be read") as info:
        trainer.fit(Regressor(), failing_loader(fail_at=20, from_read=32))  # replica 0's second epoch
    assert note(info.value) == ("(raised while loading batch index 1 of DataLoader over FailingDataset; "
                                "the batches before it were used)\n"
                                "(raised in replica 0 of 2; the other replicas were stopped)")
    cause = info.value.__cause__
    assert isinstance(cause, ReplicaFailure)
    assert "in __getitem__" in str(cause) and "failing_data.py" in str(cause)


@pytest.mark.multi_device
def test_spmd(tmp_path):
    trainer = Trainer(strategy="xla_spmd", devices=2, max_epochs=1, default_root_dir=str(tmp_path),
                      enable_progress_bar=False, logger=False, enable_checkpointing=False)
    with pytest.raises(DataError, match="sample 20 cannot be read") as info:
        trainer.fit(Regressor(), failing_loader(fail_at=20))
    assert "(raised while loading batch index 2 of DataLoader over FailingDataset;" in note(info.value)
    assert "in __getitem__" in str(info.value.__cause__)


@pytest.mark.parametrize("stage", ["train", "val"])
def test_the_command_line_exits_with_an_error(tmp_path, stage):
    config = tmp_path / "failing.yaml"
    config.write_text(f"model:\n  _target_: conftest.Regressor\ndata:\n  _target_: failing_data.FailingData\n"
                      f"  stage: {stage}\n  fail_at: 9\ntrainer:\n  max_epochs: 1\n  enable_progress_bar: false\n"
                      f"  logger: false\n  default_root_dir: {tmp_path / 'runs'}\n")
    exe = os.path.join(os.path.dirname(sys.executable), "xtrainer")
    done = subprocess.run([exe, "fit", "--config", str(config)], capture_output=True, text=True, cwd=TESTS,
                          env={**os.environ, "PJRT_DEVICE": "CPU"}, timeout=subprocess_timeout(600))
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert lines[-2:] == ["failing_data.DataError: sample 9 cannot be read",
                          "(raised while loading batch index 1 of DataLoader over FailingDataset; "
                          "the batches before it were used)"], done.stderr[-3000:]
    assert not finished(done.stdout)
