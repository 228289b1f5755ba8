"""Stops at awkward moments (an epoch's last batch, its validation, between micro-batches, right
after a mid-epoch validation), each resumed from ``last`` and compared bitwise with a run that was
never stopped. Real processes, real SIGTERM and SIGKILL."""

import json
import os
import signal
import subprocess
import sys

import conftest
import pytest
import torch

import edge_run
from conftest import subprocess_timeout
from xtrainer.checkpoint import load_checkpoint

TESTS = os.path.dirname(os.path.abspath(conftest.__file__))


def start(spec):
    done = subprocess.run([sys.executable, edge_run.__file__, json.dumps(spec)], cwd=TESTS, capture_output=True,
                          text=True, timeout=subprocess_timeout(600), env={**os.environ, "PJRT_DEVICE": "CPU"})
    return done.returncode, done.stderr


_STRAIGHT = {}


def straight(tmp_path, **spec):
    """The outcome of ``spec`` never stopped (computed once per spec: several tests compare with
    the same run)."""
    key = json.dumps(spec, sort_keys=True)
    if key not in _STRAIGHT:
        _STRAIGHT[key] = _straight(tmp_path, **spec)
    return _STRAIGHT[key]


def _straight(tmp_path, **spec):
    spec = {**spec, "root": str(tmp_path / "straight"), "event": None}
    if spec.get("devices", 1) == 1:
        return edge_run.outcome(*edge_run.run(spec))
    spec["out"] = str(tmp_path / "straight.pt")
    code, err = start(spec)
    assert code == 0, err[-3000:]
    return torch.load(spec["out"], weights_only=True)


def stopped_then_resumed(tmp_path, event, expect=143, check=None, **spec):
    """Run ``spec`` in a process of its own until ``event`` stops it (exit status ``expect``), then
    (after ``check(stderr)``) resume it from ``last`` to the end; the resumed run's outcome and the
    stopped run's stderr. One replica resumes in this process (``edge_run.run`` seeds everything
    it draws from, so only the checkpoint carries the stopped run's state, as in a fresh process);
    several in a process of their own, as the stopped run."""
    root = str(tmp_path / "run")
    code, err = start({**spec, "root": root, "event": event})
    assert code == expect, err[-3000:]
    if check is not None:
        check(err)
    if spec.get("devices", 1) == 1:
        return edge_run.outcome(*edge_run.run({**spec, "root": root, "resume": True})), err
    out = str(tmp_path / "resumed.pt")
    code, resumed_err = start({**spec, "root": root, "resume": True, "out": out})
    assert code == 0, resumed_err[-3000:]
    return torch.load(out, weights_only=True), err


def assert_same(resumed, reference):
    for name, tensor in reference["state_dict"].items():
        assert torch.equal(resumed["state_dict"][name], tensor), name
    assert resumed["global_step"] == reference["global_step"]
    for name, value in reference["metrics"].items():
        assert resumed["metrics"][name] == value, name


def interrupted_checkpoint(err):
    line = next(line for line in err.splitlines() if "Stopped by SIGTERM" in line)
    return load_checkpoint(line.split("checkpoint: ")[1].split(". Resume")[0])


def test_sigterm_on_an_epochs_last_batch_is_an_interruption_and_resumes_bitwise(tmp_path):
    resumed, err = stopped_then_resumed(tmp_path, "term@0:7")
    assert "at step 8, epoch 1" in err  # the epoch was finished: the next one starts on resume
    assert_same(resumed, straight(tmp_path))


def test_sigterm_during_the_epoch_end_validation_is_an_interruption(tmp_path):
    resumed, err = stopped_then_resumed(tmp_path, "term@val:1")
    assert "Stopped by SIGTERM at step 16" in err
    assert_same(resumed, straight(tmp_path))


def test_sigterm_on_the_last_batch_of_the_fit_is_a_finished_fit(tmp_path):
    code, err = start({"root": str(tmp_path / "run"), "event": "term@2:7"})
    assert code == 0, err[-3000:]


@pytest.mark.multi_device
def test_replicas_that_agree_to_stop_at_an_epochs_end_are_interrupted(tmp_path):
    """Epochs shorter than log_every_n_steps: the replicas agree on the stop at the epoch's end."""
    resumed, err = stopped_then_resumed(tmp_path, "term@1:2", devices=2)
    assert "at step 16, epoch 2" in err
    assert_same(resumed, straight(tmp_path, devices=2))


def test_sigterm_between_micro_batches_stops_at_the_optimizer_step_and_resumes_bitwise(tmp_path):
    spec = {"accumulate": 3, "log_every_n_steps": 1}
    def at_the_step(err):
        saved = interrupted_checkpoint(err)
        assert saved["loops"]["batches_in_epoch"] == 6  # the accumulation finished: batches 3, 4 and 5

    resumed, _ = stopped_then_resumed(tmp_path, "term@1:3", check=at_the_step, **spec)
    assert_same(resumed, straight(tmp_path, **spec))


def test_killed_right_after_a_mid_epoch_validation_resumes_bitwise(tmp_path):
    spec = {"val_check_interval": 0.5, "checkpoint": {}}
    def validated(err):
        last = load_checkpoint(str(tmp_path / "run" / "version_0" / "checkpoints" / "last.ckpt"))
        assert last["loops"]["global_step"] == 12 and not last["loops"]["validation_pending"]

    resumed, _ = stopped_then_resumed(tmp_path, "kill@valend:12", expect=-signal.SIGKILL, check=validated, **spec)
    assert_same(resumed, straight(tmp_path, **spec))


def test_a_checkpoint_written_on_a_signal_never_enters_the_top_k(tmp_path):
    spec = {"epochs": 4, "checkpoint": {"monitor": "val_loss", "every_n_epochs": 2, "save_top_k": 1}}
    root = tmp_path / "run"
    # In epoch 3, val_loss is epoch 2's (validated every epoch, saved every other): not a score of
    # the weights the signal's checkpoint holds.
    code, err = start({**spec, "root": str(root), "event": "term@3:3"})
    assert code == 143, err[-3000:]
    saved = interrupted_checkpoint(err)
    state = next(v for k, v in saved["callbacks"].items() if k.startswith("ModelCheckpoint"))
    best = state["best_model_path"]
    assert "epoch=1" in os.path.basename(best) and os.path.exists(best)  # the validated best is kept
    assert list(state["best_k_models"]) == [best]


def test_a_checkpoint_written_on_a_signal_without_save_last_is_replaced_by_the_next_save(tmp_path):
    spec = {"epochs": 3, "checkpoint": {"save_last": False, "save_top_k": 1}}
    root = tmp_path / "run"
    code, err = start({**spec, "root": str(root), "event": "term@1:3"})
    assert code == 143, err[-3000:]
    interrupted = err.split("checkpoint: ")[1].split(". Resume")[0]
    assert os.path.exists(interrupted)
    code, err = start({**spec, "root": str(root), "resume": True})
    assert code == 0, err[-3000:]
    # The restart claimed version_1; save_top_k=1 bounds what the lineage keeps on disk.
    left = sorted(str(p.relative_to(root)) for p in root.glob("version_*/checkpoints/*.ckpt"))
    assert left == ["version_1/checkpoints/epoch=2-step=24.ckpt"]


@pytest.mark.parametrize("sampler", ["weighted", "subset", "iterable"])
def test_samplers_xtrainer_does_not_replace_continue_their_order_on_resume(tmp_path, sampler):
    resumed, _ = stopped_then_resumed(tmp_path, "term@1:4", sampler=sampler)
    assert_same(resumed, straight(tmp_path, sampler=sampler))


def test_epoch_values_after_a_mid_epoch_resume_cover_the_whole_epoch(tmp_path):
    resumed, _ = stopped_then_resumed(tmp_path, "term@2:4")
    reference = straight(tmp_path)
    assert "train_loss_epoch" in reference["metrics"]
    assert_same(resumed, reference)


def test_consolidating_a_checkpoint_that_a_fit_re_points_reads_one_whole_checkpoint(tmp_path):
    """``last.ckpt`` re-pointed between two sharded checkpoints (and the one not pointed at
    removed and put back) while it is consolidated: every answer is exactly one of the two."""
    import shutil
    import threading

    from conftest import Regressor, make_loader

    from xtrainer import Trainer
    from xtrainer.callbacks import ModelCheckpoint
    from xtrainer.checkpoint import CheckpointError, consolidate, folders, storage

    folder = tmp_path / "ckpts"
    Trainer(strategy="xla_fsdp", max_steps=2, enable_progress_bar=False, logger=False, enable_xla_health=False,
            default_root_dir=str(tmp_path), num_sanity_val_steps=0,
            callbacks=[ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1, save_last=False)]
            ).fit(Regressor(), make_loader())
    first, second = sorted(str(p) for p in folder.iterdir())
    wholes = [consolidate(first), consolidate(second)]
    spare = str(tmp_path / "spare")
    shutil.copytree(first, spare)
    stop = threading.Event()

    def churn():
        targets = [first, second]
        while not stop.is_set():
            for target in targets:
                folders.link_last(str(folder), target)
                other = targets[1 - targets.index(target)]
                storage.remove(other)  # pruned as a fit prunes, then written again (staged and
                staging = other + ".staging"                # renamed into place, as a save does)
                shutil.copytree(spare if other == first else second + ".keep", staging)
                os.rename(staging, other)

    shutil.copytree(second, second + ".keep")
    folders.link_last(str(folder), first)
    worker = threading.Thread(target=churn)
    worker.start()
    answers = removed = 0
    last_error = None
    try:
        for _ in range(400):
            if answers >= 30:
                break
            try:
                got = consolidate(str(folder / "last.ckpt"))
            except CheckpointError as err:
                assert "was removed while it was being read" in str(err) or "does not exist" in str(err), err
                removed, last_error = removed + 1, str(err)
                continue
            assert any(all(torch.equal(got[k], w[k]) for k in w) and got.keys() == w.keys() for w in wholes)
            answers += 1
    finally:
        stop.set()
        worker.join()
    assert answers > 0, (removed, first, second, last_error)
    assert not [p for p in folder.iterdir() if p.name.startswith(".tmp-")]  # no pin left behind


def test_a_folder_replaced_under_its_name_while_it_is_pinned_is_pinned_whole(tmp_path, monkeypatch):
    """A pin lists the folder just as a writer replaces it: the old folder, renamed away, is being
    deleted, so the listing holds only part of it (here without its manifest), and the new folder
    is in place under the name. The pin holds the whole new folder, never the part."""
    import shutil

    from xtrainer.checkpoint import folders, storage

    names = ["manifest.json", "shard-0.pt", "shard-1.pt", "trainer.pt"]
    spare = tmp_path / "spare"
    spare.mkdir()
    for name in names:
        (spare / name).write_text(name)
    target = str(tmp_path / "ckpts" / "epoch=0-step=2.ckpt")
    shutil.copytree(spare, target)
    listdir, replaced = os.listdir, []

    def listdir_while_replaced(path="."):
        listed = listdir(path)
        if os.fspath(path) == target and not replaced:  # the writer, at this moment: remove, write again
            replaced.append(True)
            storage.remove(target)
            shutil.copytree(spare, target)
            return [name for name in listed if name != "manifest.json"]  # deleted before it was read
        return listed

    monkeypatch.setattr(os, "listdir", listdir_while_replaced)
    with folders.pinned(target) as pin:
        assert replaced and sorted(listdir(pin)) == names
    assert listdir(tmp_path / "ckpts") == ["epoch=0-step=2.ckpt"]  # no pin left behind
