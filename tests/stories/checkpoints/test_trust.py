"""Checkpoints and runs you can trust: nothing in a checkpoint runs, damage is found before any
state is touched, a non-finite loss never costs a good checkpoint, runs never share a folder,
leftovers of crashed saves are cleared. Real files, real pickles, real processes."""

import decimal
import os
import subprocess
import sys
import time

import conftest
import pytest
import torch
from conftest import Regressor, make_loader, subprocess_timeout
from torch.utils.data import DataLoader, TensorDataset

from xtrainer import Trainer, cli
from xtrainer.callbacks import ModelCheckpoint
from xtrainer.checkpoint import CheckpointError, UnsafeCheckpointError, consolidate, load_checkpoint, storage

TESTS = os.path.dirname(os.path.abspath(conftest.__file__))
CLI = os.path.join(os.path.dirname(sys.executable), "xtrainer")


class Payload:
    """A pickle that runs a command when loaded without a weights-only unpickler."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def fit(root, epochs=1, ckpt_path=None, callbacks=(), loader=None, **kwargs):
    model = Regressor(optimizer="adam", lr=0.01)
    kwargs.setdefault("strategy", "xla_native")  # these runs are torch_xla's (their checkpoints name it)
    trainer = Trainer(max_epochs=epochs, default_root_dir=str(root), enable_progress_bar=False, logger=False,
                      callbacks=list(callbacks), **kwargs)
    trainer.fit(model, loader or make_loader(), ckpt_path=ckpt_path)
    return trainer, model


def malicious_checkpoint(path, marker):
    """A whole-file checkpoint with a valid header and zip directory whose state runs a command."""
    torch.save({"format": "xtrainer", "format_version": 2, "strategy": "xla_native", "world_size": 1,
                "loops": {"global_step": 99, "epoch": 0, "batches_in_epoch": 0, "epoch_finished": True},
                "state_dict": Payload(marker)}, path)


def folder_with(path, files, layout):
    """A checkpoint folder holding ``files`` ({name: bytes}) with a manifest that agrees: what an
    attacker who can write the folder can make."""
    listing = {}
    for name, data in files.items():
        written = storage.write_bytes(data, os.path.join(path, name))
        listing[name] = {"size": written.size, "sha256": written.sha256, "rank": 0}
    storage.write_manifest(path, listing, {"format": "xtrainer", "format_version": 2, "layout": layout,
                                           "strategy": "xla_fsdp", "world_size": 1})


def saved_bytes(obj):
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_no_entry_point_runs_code_from_a_checkpoint(tmp_path, capsys):
    marker = tmp_path / "pwned"
    planted = tmp_path / "runs" / "version_0" / "checkpoints"
    planted.mkdir(parents=True)
    bad = planted / "last.ckpt"  # ckpt_path="last" finds it in the run's lineage
    malicious_checkpoint(bad, marker)
    refused = f"{bad}' was refused: it names posix.system"
    with pytest.raises(UnsafeCheckpointError, match=refused):
        fit(tmp_path / "runs", ckpt_path=str(bad))
    with pytest.raises(CheckpointError, match=f"no checkpoint in the run's lineage can be resumed:\n  {bad}: "
                       ".*posix.system"):
        fit(tmp_path / "runs", ckpt_path="last")
    trainer = Trainer(default_root_dir=str(tmp_path / "eval"), enable_progress_bar=False, logger=False)
    for run in (trainer.validate, trainer.test, trainer.predict):
        with pytest.raises(UnsafeCheckpointError, match=refused):
            run(Regressor(), make_loader(), ckpt_path=str(bad))
    with pytest.raises(UnsafeCheckpointError, match=refused):
        load_checkpoint(bad)

    header = {"format": "xtrainer", "format_version": 2, "strategy": "xla_fsdp", "world_size": 1,
              "loops": {"global_step": 1, "epoch": 0, "batches_in_epoch": 0, "epoch_finished": True}}
    fsdp = tmp_path / "fsdp.ckpt"  # an FSDP folder whose trainer.pt runs a command
    folder_with(fsdp, {"trainer.pt": saved_bytes({**header, "callbacks": Payload(marker)})}, "fsdp")
    spmd = tmp_path / "spmd.ckpt"  # an SPMD folder whose torch.distributed.checkpoint metadata does
    import pickle

    folder_with(spmd, {"trainer.pt": saved_bytes(header), "state/.metadata": pickle.dumps(Payload(marker))},
                "distributed")
    with pytest.raises(UnsafeCheckpointError, match="trainer.pt' was refused: it names posix.system"):
        consolidate(fsdp)
    with pytest.raises(UnsafeCheckpointError, match="metadata .*state/.metadata' was refused: it names posix.system"):
        consolidate(spmd)
    with pytest.raises(UnsafeCheckpointError, match="state/.metadata' was refused"):
        fit(tmp_path / "runs", ckpt_path=str(spmd))  # xla_native reads an SPMD folder whole
    done = subprocess.run([CLI, "consolidate", str(fsdp), "-o", str(tmp_path / "out.pt")], capture_output=True,
                          text=True, env={**os.environ, "PJRT_DEVICE": "CPU"})  # the real command
    assert done.returncode == 1 and "was refused: it names posix.system" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    capsys.readouterr()
    assert cli.main(["consolidate", str(spmd), "-o", str(tmp_path / "out.pt")]) == 1
    assert "was refused: it names posix.system" in capsys.readouterr().err
    assert not marker.exists()  # nothing ran, anywhere


def test_a_checkpoint_that_would_not_read_back_safely_is_refused_when_written(tmp_path):
    from xtrainer.callbacks import Callback

    class Holder(Callback):
        def on_save_checkpoint(self, trainer, module, checkpoint):
            checkpoint["mine"] = {"when": decimal.Decimal("1.5")}

    with pytest.raises(CheckpointError, match=r"checkpoint\['mine'\]\['when'\] is a decimal.Decimal: checkpoints "
                       "hold plain data only"):
        fit(tmp_path, callbacks=[Holder()])


def test_hyperparameters_are_kept_as_plain_data(tmp_path):
    from omegaconf import OmegaConf

    class Configured(Regressor):
        def __init__(self):
            super().__init__(optimizer="adam", lr=0.01)
            self.save_hyperparameters(cfg=OmegaConf.create({"width": 16, "act": ["tanh"]}), where=tmp_path,
                                      fn=len)

    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False)
    trainer.fit(Configured(), make_loader())
    ckpt = torch.load(os.path.join(trainer.log_dir, "checkpoints", "epoch=0-step=8.ckpt"), weights_only=True)
    assert ckpt["hyper_parameters"] == {"cfg": {"width": 16, "act": ["tanh"]}, "where": str(tmp_path),
                                        "fn": "<built-in function len>"}


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_a_flipped_bit_in_a_tensor_is_found_before_anything_loads(tmp_path):
    saver = ModelCheckpoint(every_n_train_steps=4, save_top_k=-1)
    trainer, _ = fit(tmp_path, callbacks=[saver])
    newest = os.path.join(saver.dirpath, "epoch=0-step=8.ckpt")
    import zipfile

    with zipfile.ZipFile(newest) as archive:  # a byte inside the first tensor's data record
        info = next(i for i in archive.infolist() if "/data/" in i.filename and i.file_size > 16)
    with open(newest, "rb") as f:
        f.seek(info.header_offset)
        local = f.read(30)  # the record's local header: its name and extra field come before the data
    offset = info.header_offset + 30 + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")
    offset += 8
    flip_byte(newest, offset)
    with pytest.raises(CheckpointError, match=f"{newest}' is corrupt: its record .*data/.* does not match its "
                       "checksum"):
        load_checkpoint(newest)
    with pytest.raises(CheckpointError, match="is corrupt"):
        fit(tmp_path / "again", ckpt_path=newest)
    with pytest.warns(UserWarning, match="resuming from .*step=4.ckpt.*skipped:\n  .*step=8.ckpt.*is corrupt"):
        resumed, _ = fit(tmp_path, epochs=2, ckpt_path="last")
    assert resumed.global_step == 16 and resumed.ckpt_path.endswith("epoch=0-step=4.ckpt")


def test_fsdp_shards_flipped_truncated_or_lost_are_named(tmp_path):
    trainer, _ = fit(tmp_path, strategy="xla_fsdp")
    path = os.path.join(trainer.log_dir, "checkpoints", "epoch=0-step=8.ckpt")
    shard = os.path.join(path, "rank-00000-of-00001.pt")
    original = open(shard, "rb").read()
    flip_byte(shard, len(original) // 2)
    with pytest.raises(CheckpointError, match="rank-00000-of-00001.pt' \\(it belongs to rank 0\\) does not match its "
                       "checksum"):
        consolidate(path)
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        fit(tmp_path / "b", strategy="xla_fsdp", ckpt_path=path)
    with open(shard, "wb") as f:
        f.write(original[:100])
    with pytest.raises(CheckpointError, match="has 100 bytes, but its manifest says"):
        consolidate(path)
    os.remove(os.path.join(path, "manifest.json"))  # as a save killed before its end would leave it
    with pytest.raises(CheckpointError, match="has no manifest.json: the save that wrote it did not finish"):
        consolidate(path)


def test_a_nonfinite_loss_never_costs_a_good_checkpoint(tmp_path):
    data = make_loader().dataset
    x, y = data.tensors[0].clone(), data.tensors[1].clone()
    x[40:48] = float("nan")  # batch 5: the loss of the step to global step 6 is NaN
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    saver = ModelCheckpoint(every_n_train_steps=2, save_top_k=2)
    with pytest.warns(UserWarning, match="no checkpoint at step 6: the training loss became NaN or infinite at "
                      "step 5.*stays .*step=4.ckpt"):
        trainer, _ = fit(tmp_path, epochs=2, callbacks=[saver], loader=loader, detect_nonfinite="warn",
                         log_every_n_steps=1)
    names = sorted(os.listdir(saver.dirpath))
    assert names == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    last = load_checkpoint(os.path.join(saver.dirpath, "last.ckpt"))
    assert last["loops"]["global_step"] == 4
    assert all(torch.isfinite(t).all() for t in last["state_dict"].values())

    saver = ModelCheckpoint(every_n_train_steps=2, save_top_k=1)
    with pytest.raises(FloatingPointError, match="at global step 5"):
        fit(tmp_path / "raise", epochs=2, callbacks=[saver], loader=loader, log_every_n_steps=4)
    assert os.path.realpath(os.path.join(saver.dirpath, "last.ckpt")).endswith("epoch=0-step=4.ckpt")


CLAIM = """
import sys, time
sys.path.insert(0, {tests!r})
import conftest
from xtrainer import Trainer
from xtrainer.callbacks import ModelCheckpoint
start = {start}
time.sleep(max(0.0, start - time.time()))
trainer = Trainer(max_steps=2, default_root_dir={root!r}, enable_progress_bar=False, logger=False,
                  callbacks=[ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)])
trainer.fit(conftest.Regressor(lr=float(sys.argv[1])), conftest.make_loader())
print(trainer.log_dir)
"""


def test_runs_started_in_the_same_second_never_share_a_folder(tmp_path):
    root = str(tmp_path / "runs")
    script = CLAIM.format(tests=TESTS, start=time.time() + 12, root=root)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(lr)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "PJRT_DEVICE": "CPU"}) for lr in (0.01, 0.02, 0.03)]
    folders = []
    for proc in procs:
        out, err = proc.communicate(timeout=subprocess_timeout(240))
        assert proc.returncode == 0, err[-2000:]
        folders.append(out.strip().splitlines()[-1])
    assert sorted(folders) == [os.path.join(root, f"version_{i}") for i in range(3)]
    weights = [load_checkpoint(os.path.join(f, "checkpoints", "epoch=0-step=2.ckpt"))["state_dict"]["net.0.weight"]
               for f in folders]
    assert not torch.equal(weights[0], weights[1]) and not torch.equal(weights[1], weights[2])  # each its own


def test_leftovers_of_crashed_saves_are_removed_at_the_next_start(tmp_path):
    import socket

    dirpath = tmp_path / "ckpts"
    dirpath.mkdir()
    host = socket.gethostname()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        (dirpath / f".tmp-{host}-{dead_pid}-abcd1234-epoch=0-step=3.ckpt").write_bytes(b"partial")
        (dirpath / f".tmp-{host}-{dead_pid}-abcd1234-epoch=0-step=6.ckpt").mkdir()  # a staging folder
        alive = dirpath / f".tmp-{host}-{sleeper.pid}-abcd1234-epoch=0-step=9.ckpt"  # another run, still saving
        alive.write_bytes(b"in progress")
        other_host = dirpath / f".tmp-elsewhere-{dead_pid}-abcd1234-x.ckpt"  # cannot tell: left alone
        other_host.write_bytes(b"?")
        fit(tmp_path, callbacks=[ModelCheckpoint(dirpath=str(dirpath))])
        assert sorted(p.name for p in dirpath.iterdir() if p.name.startswith(".")) == sorted([alive.name,
                                                                                              other_host.name])
    finally:
        sleeper.kill()


def test_resuming_says_what_it_does_and_the_saved_config_names_the_file(tmp_path, capsys, monkeypatch):
    saver = ModelCheckpoint(every_n_train_steps=4, save_top_k=-1)
    fit(tmp_path, callbacks=[saver])
    capsys.readouterr()
    trainer, _ = fit(tmp_path, epochs=2, ckpt_path="last")
    newest = os.path.join(saver.dirpath, "epoch=0-step=8.ckpt")
    assert capsys.readouterr().out.splitlines()[0] == (
        f"xtrainer: resuming from {newest} (strategy xla_native, world size 1, epoch 0, step 8)")
    assert trainer.ckpt_path == newest

    monkeypatch.chdir(TESTS)
    config = tmp_path / "run.yaml"
    config.write_text("model: {_target_: conftest.Regressor, optimizer: adam, lr: 0.01}\ndata: {_target_: conftest.RegressionData}\n"
                      f"trainer: {{max_epochs: 3, enable_progress_bar: false, logger: false, "
                      f"default_root_dir: {tmp_path}}}\nckpt_path: last\n")
    done = subprocess.run([CLI, "fit", "--config", str(config)], capture_output=True, text=True,
                          env={**os.environ, "PJRT_DEVICE": "CPU"}, cwd=TESTS)
    assert done.returncode == 0, done.stderr[-2000:]
    run_folder = done.stdout.split("run folder ")[1].split(" ")[0]
    with open(os.path.join(run_folder, "config.yaml")) as f:
        saved = f.read()
    assert f"ckpt_path: {os.path.join(tmp_path, 'version_1', 'checkpoints', 'epoch=1-step=16.ckpt')}" in saved


def test_last_takes_only_what_this_run_can_resume(tmp_path):
    native, _ = fit(tmp_path)  # version_0: an xla_native checkpoint
    time.sleep(0.05)
    fit(tmp_path, strategy="xla_fsdp")  # version_1: newer, but xla_native cannot resume an FSDP folder
    with pytest.warns(UserWarning, match="resuming from .*version_0.*epoch=0-step=8.ckpt.*skipped:\n  "
                      ".*version_1.*epoch=0-step=8.ckpt: it was written by xla_fsdp with 1 replica\\(s\\); "
                      "xla_native at world size 1 cannot resume it"):
        resumed, _ = fit(tmp_path, epochs=2, ckpt_path="last")
    assert resumed.global_step == 16
    fit(tmp_path / "fsdp-only", strategy="xla_fsdp")
    with pytest.raises(CheckpointError, match="no checkpoint in the run's lineage can be resumed:\n  .*xla_native at "
                       "world size 1 cannot resume it"):
        fit(tmp_path / "fsdp-only", epochs=2, ckpt_path="last")


def test_a_checkpoint_cannot_make_the_trainer_delete_files(tmp_path):
    trainer, _ = fit(tmp_path / "a")
    good = os.path.join(trainer.log_dir, "checkpoints", "epoch=0-step=8.ckpt")
    victim = tmp_path / "precious"
    victim.mkdir()
    (victim / "data.txt").write_text("keep me")
    ckpt = torch.load(good, weights_only=True)
    for state in ckpt["callbacks"].values():
        if "best_k_models" in state:  # bookkeeping that names a folder of the user's, and no dirpath
            state.update(best_k_models={str(victim): -1.0}, last_model_path=str(victim))
            state.pop("dirpath")
    crafted = tmp_path / "crafted.ckpt"
    torch.save(ckpt, crafted)
    fit(tmp_path / "b", epochs=3, ckpt_path=str(crafted))
    assert (victim / "data.txt").read_text() == "keep me"


def test_two_checkpoint_callbacks_keep_their_own_files_across_a_resume(tmp_path):
    dirpath = str(tmp_path / "ckpts")

    def callbacks():
        return [ModelCheckpoint(dirpath=dirpath, filename="ep{epoch}", auto_insert_metric_name=False),
                ModelCheckpoint(dirpath=dirpath, every_n_train_steps=4, filename="s{step}", save_top_k=-1,
                                save_last=False, auto_insert_metric_name=False)]

    fit(tmp_path, callbacks=callbacks())
    fit(tmp_path, epochs=2, ckpt_path="last", callbacks=callbacks())
    assert sorted(os.listdir(dirpath)) == ["ep1.ckpt", "last.ckpt", "s12.ckpt", "s16.ckpt", "s4.ckpt", "s8.ckpt"]


def test_malformed_files_are_refused_in_one_line_and_last_falls_back(tmp_path):
    saver = ModelCheckpoint(every_n_train_steps=4, save_top_k=-1)
    fit(tmp_path, callbacks=[saver])
    newest = os.path.join(saver.dirpath, "epoch=0-step=8.ckpt")
    ckpt = torch.load(newest, weights_only=True)
    torch.save({**ckpt, "loops": []}, newest)  # well-formed zip, malformed header
    with pytest.raises(CheckpointError, match="malformed header"):
        fit(tmp_path / "x", ckpt_path=newest)
    with pytest.warns(UserWarning, match="resuming from .*step=4.ckpt.*skipped:\n  .*step=8.ckpt.*malformed header"):
        resumed, _ = fit(tmp_path, epochs=2, ckpt_path="last")
    assert resumed.global_step == 16
    with pytest.raises(CheckpointError, match="is a folder, not a checkpoint .* It holds epoch=0-step=4.ckpt"):
        fit(tmp_path / "y", ckpt_path=saver.dirpath)


def test_consolidate_never_overwrites_what_it_reads(tmp_path, capsys):
    trainer, _ = fit(tmp_path)
    ckpt = os.path.join(trainer.log_dir, "checkpoints", "epoch=0-step=8.ckpt")
    before = open(ckpt, "rb").read()
    assert cli.main(["consolidate", ckpt, "-o", ckpt]) == 1
    assert "would overwrite the checkpoint it reads" in capsys.readouterr().err
    assert open(ckpt, "rb").read() == before
    out = tmp_path / "weights.pt"  # a whole file consolidates to its state dict
    assert cli.main(["consolidate", ckpt, "-o", str(out)]) == 0
    Regressor().load_state_dict(torch.load(out, weights_only=True), strict=True)


def test_numpy_and_circular_values(tmp_path):
    import numpy as np

    from xtrainer.callbacks import Callback
    from xtrainer.checkpoint.format import plain_hparams

    assert plain_hparams({"lr": np.float64(0.1), "n": np.int64(3), "b": np.bool_(True)}) == {
        "lr": 0.1, "n": 3, "b": True}

    class Circular(Callback):
        def state_dict(self):
            state = {"history": []}
            state["history"].append(state)
            return state

    with pytest.raises(CheckpointError, match=r"Circular'\]\['history'\]\[0\] contains itself"):
        fit(tmp_path, callbacks=[Circular()])
