"""Writes that must not be lost or leaked: a save after an asynchronous fit is complete when it
returns (also in a process that exits at once); what a killed writer left is removed at the next
start even when the restarted process has the same PID (a container's PID 1)."""

import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import Regressor, make_loader

from xtrainer import Trainer
from xtrainer.callbacks import ModelCheckpoint
from xtrainer.checkpoint import background, load_checkpoint, storage

TESTS = os.path.dirname(os.path.abspath(__file__))
ENV = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": os.pathsep.join([TESTS, os.path.dirname(TESTS)])}


# ---- a save after an asynchronous fit ---------------------------------------------------------
SAVE_AND_EXIT = textwrap.dedent("""
    import os, sys, time
    import conftest
    from xtrainer import Trainer
    from xtrainer.callbacks import ModelCheckpoint
    from xtrainer.checkpoint import storage

    strategy, root, path = sys.argv[1:4]
    write = storage._HashingWriter.write

    def slow_write(self, data):  # a slow disk: every chunk of every checkpoint write takes 20 ms
        time.sleep(0.02)
        return write(self, data)

    storage._HashingWriter.write = slow_write
    trainer = Trainer(strategy=strategy, max_steps=4, default_root_dir=root, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, async_checkpointing=True,
                      callbacks=[ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)])
    trainer.fit(conftest.Regressor(), conftest.make_loader(64, 8))
    trainer.save_checkpoint(path)
    print("saved", os.path.exists(path), flush=True)
""")


@pytest.mark.parametrize("strategy", ["native", "xla_native"])
def test_a_save_after_an_asynchronous_fit_is_written_before_the_process_exits(tmp_path, strategy):
    path = tmp_path / "out" / "fitted.ckpt"
    done = subprocess.run([sys.executable, "-c", SAVE_AND_EXIT, strategy, str(tmp_path / "run"), str(path)],
                          capture_output=True, text=True, timeout=300, env=ENV, cwd=TESTS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "saved True" in done.stdout, done.stdout[-2000:]  # complete when save_checkpoint returned
    assert path.is_file() and not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]
    assert set(load_checkpoint(str(path))["state_dict"]) == set(Regressor().state_dict())
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"  # the fit's own, written in the background
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    assert load_checkpoint(str(checkpoints / "last.ckpt"))["loops"]["global_step"] == 4


def test_background_writes_are_on_only_while_a_stage_runs(tmp_path):
    assert not background.enabled()
    seen = []

    class Watch(ModelCheckpoint):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen.append(background.enabled())

    trainer = Trainer(max_steps=2, default_root_dir=str(tmp_path), logger=False, enable_progress_bar=False,
                      enable_model_summary=False, async_checkpointing=True, callbacks=[Watch()])
    trainer.fit(Regressor(), make_loader(32, 8))
    assert seen == [True, True] and not background.enabled()

    class Fails(ModelCheckpoint):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            raise RuntimeError("a callback fails")

    trainer = Trainer(max_steps=2, default_root_dir=str(tmp_path), logger=False, enable_progress_bar=False,
                      enable_model_summary=False, async_checkpointing=True, callbacks=[Fails()])
    with pytest.raises(RuntimeError, match="a callback fails"):
        trainer.fit(Regressor(), make_loader(32, 8))
    assert not background.enabled()  # off again after a failed stage too


PENDING_AT_EXIT = textwrap.dedent("""
    import os, sys, time
    from xtrainer.checkpoint import background, storage

    path = sys.argv[1]

    def write():
        time.sleep(0.5)
        storage.write_bytes(b"written", path)

    def fail():
        raise OSError("the disk went away")

    background.submit(write, save=True)  # queued, and the process ends at once
    background.submit(fail)
""")


def test_a_write_still_queued_at_exit_is_finished_and_reported():
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "late.bin")
        done = subprocess.run([sys.executable, "-c", PENDING_AT_EXIT, path], capture_output=True, text=True,
                              timeout=120, env=ENV)
        assert done.returncode == 0, done.stderr[-2000:]
        assert open(path, "rb").read() == b"written"
        assert "waiting for 2 background checkpoint write(s) still queued at exit" in done.stderr, done.stderr
        assert "a background checkpoint write failed" in done.stderr and "the disk went away" in done.stderr
