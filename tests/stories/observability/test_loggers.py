"""Loggers with Lightning's arguments and layout (TensorBoard, CSV), their run folders, and the
model summary: real files, read back; claims raced; writers killed mid-write."""

import argparse
import csv
import enum
import inspect
import glob
import os
import pathlib
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest
import torch
import yaml
from conftest import Regressor, make_loader, subprocess_timeout
from omegaconf import OmegaConf
from tbparse import SummaryReader
from torch import nn

import xtrainer.trainer
from xtrainer import Trainer, XDataModule
from xtrainer.loggers import (CSVLogger, Logger, TensorBoardLogger, claim_run_folder, claim_version_dir,
                              move_run_folder, run_folder_root)
from xtrainer.summary import human_readable_count, summarize

# Child processes import the loggers alone (no Trainer, no torch_xla), so that they start quickly.
LOAD_LOGGERS = textwrap.dedent("""
    import sys
    import xtrainer.loggers as xloggers
""")


def read_csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


# ---- folders, names, versions ------------------------------------------------------------------
@pytest.mark.parametrize("cls", [TensorBoardLogger, CSVLogger])
def test_lightning_layout_and_properties(tmp_path, cls):
    a = cls(tmp_path / "logs")
    assert (a.save_dir, a.name, a.root_dir) == (str(tmp_path / "logs"), "lightning_logs",
                                                str(tmp_path / "logs" / "lightning_logs"))
    assert a.version == 0 and a.log_dir == str(tmp_path / "logs" / "lightning_logs" / "version_0")
    a.log_metrics({"x": 1.0}, 0)
    a.finalize("success")
    b = cls(str(tmp_path / "logs"))
    assert b.version == 1  # the next number on disk
    assert cls(tmp_path / "logs", name="exp", version=7).log_dir == str(tmp_path / "logs" / "exp" / "version_7")
    assert cls(tmp_path / "logs", name="", version="baseline").log_dir == str(tmp_path / "logs" / "baseline")
    assert cls(tmp_path / "logs", name=None, version=2).log_dir == str(tmp_path / "logs" / "version_2")
    assert cls(tmp_path / "logs", name="group/exp").root_dir == str(tmp_path / "logs" / "group" / "exp")
    assert isinstance(a, Logger) and a.group_separator == "/"
    a.after_save_checkpoint(object())  # a no-op, as in Lightning


def test_tensorboard_sub_dir_is_inside_the_version_folder(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="exp", version=0, sub_dir="train")
    assert logger.log_dir == str(tmp_path / "exp" / "version_0" / "train")
    assert logger.version_dir == str(tmp_path / "exp" / "version_0")
    logger.log_metrics({"loss": 1.0}, 3)
    logger.finalize()
    assert list(SummaryReader(logger.log_dir).scalars.tag) == ["loss"]


@pytest.mark.parametrize("version", ["a/b", "../up", "..", ".", "", "a\\b", "a\0b"])
def test_a_version_must_name_one_folder(tmp_path, version):
    with pytest.raises(ValueError, match="must name one folder"):
        CSVLogger(tmp_path, version=version)
    with pytest.raises(ValueError, match="must name one folder"):
        TensorBoardLogger(tmp_path, version=version)


def test_bad_versions_names_and_save_dirs_are_refused_clearly(tmp_path):
    with pytest.raises(ValueError, match="numbered from 0"):
        CSVLogger(tmp_path, version=-1)
    with pytest.raises(TypeError, match="version must be"):
        CSVLogger(tmp_path, version=True)
    with pytest.raises(TypeError, match="version must be"):
        CSVLogger(tmp_path, version=1.5)
    for name in ["/etc", "../outside", "a/../../b"]:
        with pytest.raises(ValueError, match="outside save_dir"):
            TensorBoardLogger(tmp_path, name=name)
    with pytest.raises(ValueError, match="inside the version folder"):
        TensorBoardLogger(tmp_path, sub_dir="../x")
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    with pytest.raises(NotADirectoryError, match="is a file"):
        CSVLogger(a_file)
    with pytest.raises(NotADirectoryError, match="is a file"):
        TensorBoardLogger(str(a_file))
    with pytest.raises(ValueError, match="save_dir is empty"):
        CSVLogger("")
    with pytest.raises(TypeError, match="not log_dir"):  # this class's old argument
        TensorBoardLogger(log_dir=str(tmp_path))
    with pytest.raises(ValueError, match="positive int"):
        CSVLogger(tmp_path, flush_logs_every_n_steps=0)


def test_a_file_in_the_way_of_the_run_folders_is_named(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(NotADirectoryError, match="a_file.*is a file"):
        claim_run_folder([], str(a_file))
    with pytest.raises(NotADirectoryError, match="a_file"):
        claim_run_folder([CSVLogger(name="exp")], str(a_file / "below"))
    blocker = CSVLogger(tmp_path, name="exp", version=0)
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "version_0").write_text("a file where the version folder goes")
    with pytest.raises(FileExistsError, match="version_0.*a file is in the way"):
        blocker.claim()


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder nobody may write into: a read-only tmpfs as root (who ignores permissions), or
    a folder without write permission otherwise."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() == 0:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"no read-only tmpfs here: {done.stderr.strip()}")
        yield path
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
    else:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)


def test_a_read_only_folder_is_named_in_the_error(read_only_folder):
    with pytest.raises(OSError, match=r"Cannot create run folders under .*ro.*(not writable|Read-only)"):
        claim_run_folder([CSVLogger(read_only_folder, name="exp")], str(read_only_folder))
    with pytest.raises(OSError, match=r"Cannot create the run folder .*ro.*version_0"):
        claim_version_dir(str(read_only_folder))
    logger = TensorBoardLogger(read_only_folder, name="", version=3)
    with pytest.raises(OSError, match=r"version_3"):
        logger.log_metrics({"x": 1.0}, 0)


def test_a_logger_without_save_dir_waits_for_the_trainer(tmp_path):
    logger = CSVLogger()
    assert logger.save_dir is None and logger.version is None and logger.log_dir is None
    with pytest.raises(RuntimeError, match="has no save_dir"):
        logger.log_metrics({"x": 1.0}, 0)
    assert run_folder_root([logger], str(tmp_path)) == str(tmp_path / "lightning_logs")
    assert logger.save_dir == str(tmp_path)
    assert claim_run_folder([logger], str(tmp_path)) == str(tmp_path / "lightning_logs" / "version_0")
    # logger=True's logger: no name level, the run folders straight under default_root_dir
    assert claim_run_folder([TensorBoardLogger(name="")], str(tmp_path)) == str(tmp_path / "version_0")
    # no folder logger at all: the Trainer's own <default_root_dir>/version_N
    assert claim_run_folder([], str(tmp_path)) == str(tmp_path / "version_1")


def test_loggers_side_by_side_share_one_claimed_version(tmp_path):
    (tmp_path / "lightning_logs" / "version_0").mkdir(parents=True)  # an earlier run
    tb, csv_logger = TensorBoardLogger(tmp_path), CSVLogger(tmp_path)
    elsewhere = CSVLogger(tmp_path / "other", name="x")
    folder = claim_run_folder([tb, csv_logger, elsewhere], str(tmp_path))
    assert folder == tb.log_dir == csv_logger.log_dir == str(tmp_path / "lightning_logs" / "version_1")
    assert elsewhere.log_dir == str(tmp_path / "other" / "x" / "version_0") and os.path.isdir(elsewhere.log_dir)
    # a second claim (another Trainer with the same loggers) keeps the folder, as Lightning does
    assert claim_run_folder([tb, csv_logger], str(tmp_path)) == folder


def test_a_peeked_version_taken_meanwhile_is_not_shared(tmp_path):
    logger = CSVLogger(tmp_path)
    assert logger.version == 0  # Lightning's number, not reserved yet
    (tmp_path / "lightning_logs" / "version_0").mkdir(parents=True)  # another run took it
    assert logger.claim() == str(tmp_path / "lightning_logs" / "version_1")


def test_a_given_version_is_shared_on_purpose(tmp_path):
    (tmp_path / "lightning_logs" / "version_4").mkdir(parents=True)
    assert CSVLogger(tmp_path, version=4).claim() == str(tmp_path / "lightning_logs" / "version_4")
    assert CSVLogger(tmp_path, version="run-a").claim() == str(tmp_path / "lightning_logs" / "run-a")


def test_a_run_folder_given_back_is_claimed_again(tmp_path):
    logger = CSVLogger(tmp_path)
    folder = logger.claim()
    os.rmdir(folder)  # a failed run that wrote nothing leaves no folder
    assert logger.claim() == folder and os.path.isdir(folder)
    os.rmdir(folder)
    (tmp_path / "lightning_logs" / "version_1").mkdir()  # a newer run meanwhile: after it, as Lightning counts
    assert logger.claim() == str(tmp_path / "lightning_logs" / "version_2")


def test_move_run_folder_points_loggers_to_rank_zeros_folder(tmp_path):
    tb, other = TensorBoardLogger(tmp_path), CSVLogger(tmp_path / "elsewhere")
    mine = claim_run_folder([tb, other], str(tmp_path))
    ranks = str(tmp_path / "lightning_logs" / "version_7")
    os.makedirs(ranks)
    move_run_folder([tb, other], mine, ranks)
    assert tb.log_dir == ranks and tb.version == 7 and tb.save_dir == str(tmp_path)
    assert other.log_dir == str(tmp_path / "elsewhere" / "lightning_logs" / "version_0")  # not the run's
    odd = str(tmp_path / "somewhere" / "run")
    move_run_folder([tb], ranks, odd)
    assert tb.log_dir == odd and tb.version == "run"
    tb.log_metrics({"x": 1.0}, 0)
    with pytest.raises(RuntimeError, match="cannot move"):
        tb.use_run_folder(str(tmp_path / "yet_another"))
    tb.finalize()


RACE = LOAD_LOGGERS + textwrap.dedent("""
    import os, time
    root, start = sys.argv[1], float(sys.argv[2])
    loggers = [xloggers.TensorBoardLogger(root, name="exp"), xloggers.CSVLogger(root, name="exp")]
    while time.time() < start:
        pass
    print(xloggers.claim_run_folder(loggers, root))
""")


def test_runs_claiming_at_once_never_share_a_folder(tmp_path):
    root = str(tmp_path)
    start = time.time() + 1.5
    procs = [subprocess.Popen([sys.executable, "-c", RACE, root, str(start)], stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    folders = [p.communicate(timeout=subprocess_timeout(60))[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    barrier = threading.Barrier(8)
    claimed = []

    def claim():
        loggers = [CSVLogger(root, name="exp")]
        barrier.wait()
        claimed.append(claim_run_folder(loggers, root))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    folders += claimed
    assert len(folders) == len(set(folders)) == 11
    assert sorted(folders) == sorted(os.path.join(root, "exp", f"version_{i}") for i in range(11))


def test_loggers_pickle_without_their_writers(tmp_path):
    tb, csv_logger = TensorBoardLogger(tmp_path), CSVLogger(tmp_path, flush_logs_every_n_steps=1)
    tb.log_metrics({"a": 1.0}, 0)
    csv_logger.log_metrics({"a": 1.0}, 0)
    for logger in (tb, csv_logger):
        copy = pickle.loads(pickle.dumps(logger))
        assert copy._experiment is None and copy.log_dir == logger.log_dir
        copy.log_metrics({"a": 2.0}, 1)
        copy.finalize()
    tb.finalize()
    assert sorted(SummaryReader(tb.log_dir).scalars.value) == [1.0, 2.0]
    assert [r["a"] for r in read_csv(os.path.join(csv_logger.log_dir, "metrics.csv"))[1]] == ["1.0", "2.0"]


# ---- TensorBoard ---------------------------------------------------------------------------------
def hparams_view(log_dir):
    """The HPARAMS view TensorBoard shows: (hyperparameters, metric names), from the first record."""
    from tensorboard.backend.event_processing import plugin_event_accumulator as pea
    from tensorboard.plugins.hparams import metadata

    acc = pea.EventAccumulator(log_dir)
    acc.Reload()
    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)
    experiment = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
    session = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    hparams = {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in session.hparams.items()}
    return hparams, [m.name.tag for m in experiment.metric_infos]


def test_tensorboard_scalars_hp_metric_and_the_hparams_view_with_final_metrics(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="exp", prefix="run")
    params = {"lr": 0.1, "model": {"width": 16, "act": "tanh"}, "layers": [1, 2], "none": None,
              "device": torch.device("cpu"), "t": torch.tensor(3.0)}
    logger.log_hyperparams(params)  # the Trainer's call at the start of a fit
    logger.log_metrics({"loss": torch.tensor(1.5), "acc": 0.25, "flag": True}, 2)
    logger.log_metrics({"loss": 0.5, "ab": {"a": 1.0, "b": 2.0}}, 4)
    logger.log_hyperparams(params, {"loss": 0.5, "val_acc": 0.75})  # ...and at its end
    logger.finalize("success")
    scalars = SummaryReader(logger.log_dir).scalars
    got = {(t, s): v for t, s, v in zip(scalars.tag, scalars.step, scalars.value)}
    assert got[("run-hp_metric", 0)] == -1.0  # Lightning's default_hp_metric, at step 0
    assert got[("run-loss", 2)] == 1.5 and got[("run-loss", 4)] == 0.5 and got[("run-flag", 2)] == 1.0
    assert got[("run-val_acc", 4)] == 0.75  # a final metric not logged before: at the last step
    assert ("run-loss", 0) not in got  # final metrics already logged are not logged again
    hparams, metrics = hparams_view(logger.log_dir)
    assert hparams["lr"] == 0.1 and hparams["model/width"] == 16 and hparams["model/act"] == "tanh"
    assert hparams["layers"] == "[1, 2]" and hparams["none"] == "None" and hparams["device"] == "cpu"
    assert hparams["t"] == 3.0
    assert set(metrics) == {"run-loss", "run-val_acc", "run-hp_metric"}
    saved = yaml.safe_load((pathlib.Path(logger.log_dir) / "hparams.yaml").read_text())
    assert saved["model"] == {"width": 16, "act": "tanh"} and saved["device"] == "cpu" and saved["t"] == 3.0


def test_tensorboard_writes_the_view_once_and_at_finalize_without_final_metrics(tmp_path):
    logger = TensorBoardLogger(tmp_path, default_hp_metric=False)
    logger.log_hyperparams(argparse.Namespace(lr=0.01, depth=3))
    logger.log_metrics({"loss": 1.0}, 1)
    logger.finalize("failed")  # a run that failed: the view is written all the same
    hparams, metrics = hparams_view(logger.log_dir)
    assert hparams == {"lr": 0.01, "depth": 3.0} and metrics == []
    assert "hp_metric" not in set(SummaryReader(logger.log_dir).scalars.tag)
    # A user's own call with metrics writes the view at once (Lightning's recipe); later calls
    # would be hidden by TensorBoard, so they are not written.
    user = TensorBoardLogger(tmp_path, name="user", default_hp_metric=False)
    user.log_hyperparams({"lr": 1.0}, {"hp/a": 0.0})
    user.log_hyperparams({"lr": 1.0}, {"loss": 0.1})
    user.finalize()
    assert hparams_view(user.log_dir)[1] == ["hp/a"]


def test_tensorboard_refuses_values_that_are_not_numbers(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    with pytest.raises(ValueError, match="metric 'name' is 'abc'"):
        logger.log_metrics({"name": "abc"}, 0)
    with pytest.raises(ValueError, match="metric 'v' is"):
        logger.log_metrics({"v": torch.ones(3)}, 0)
    logger.log_metrics({"nan": float("nan"), "np": np.float32(2.5), "int": 3}, 1)
    logger.finalize()
    values = dict(zip(*[list(c) for c in (SummaryReader(logger.log_dir).scalars[["tag", "value"]].T.values)]))
    assert values["np"] == 2.5 and values["int"] == 3.0 and np.isnan(values["nan"])


def test_log_graph_is_accepted_with_one_warning(tmp_path):
    from xtrainer.loggers import base

    base._warned.discard("log_graph")
    with pytest.warns(UserWarning, match="not logged on XLA"):
        logger = TensorBoardLogger(tmp_path, log_graph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logger.log_graph(nn.Linear(2, 2), torch.zeros(1, 2))  # the same warning, not twice
        TensorBoardLogger(tmp_path, log_graph=True)


def test_tensorboard_passes_writer_arguments(tmp_path):
    logger = TensorBoardLogger(tmp_path, filename_suffix=".mine", max_queue=3)
    logger.log_metrics({"x": 1.0}, 0)
    logger.finalize()
    assert any(name.endswith(".mine") for name in os.listdir(logger.log_dir))


# ---- CSV -----------------------------------------------------------------------------------------
def test_csv_lightning_format_step_epoch_and_the_union_of_columns(tmp_path):
    logger = CSVLogger(tmp_path, prefix="p")
    logger.log_metrics({"train_loss": 0.5, "epoch": 0.0}, 0)
    logger.log_metrics({"train_loss": 0.25, "epoch": 0.0}, 1)
    logger.log_metrics({"val_loss": torch.tensor(0.75), "epoch": 0.0}, 1)
    logger.log_metrics({"lr": np.float64(0.1), "epoch": 1.0}, 2)
    assert not os.path.exists(os.path.join(logger.log_dir, "metrics.csv"))  # buffered: 100 steps
    logger.finalize("success")
    header, rows = read_csv(os.path.join(logger.log_dir, "metrics.csv"))
    assert header == ["p-epoch", "p-lr", "p-train_loss", "p-val_loss", "step"]
    # The prefix goes on every logged name, epoch included, as Lightning does
    assert rows == [
        {"p-epoch": "0", "p-lr": "", "p-train_loss": "0.5", "p-val_loss": "", "step": "0"},
        {"p-epoch": "0", "p-lr": "", "p-train_loss": "0.25", "p-val_loss": "", "step": "1"},
        {"p-epoch": "0", "p-lr": "", "p-train_loss": "", "p-val_loss": "0.75", "step": "1"},
        {"p-epoch": "1", "p-lr": "0.1", "p-train_loss": "", "p-val_loss": "", "step": "2"},
    ]


def test_csv_names_with_commas_quotes_newlines_and_values_of_any_kind(tmp_path):
    logger = CSVLogger(tmp_path, flush_logs_every_n_steps=1)
    names = ['a,b', 'say "hi"', "two\nlines", "crlf\r\nx", "ünï", " padded ", "=1+1"]
    for i, name in enumerate(names):
        logger.log_metrics({name: float(i)}, i)  # a new column each time: the header is rewritten
    values = {"int": 3, "big": 2 ** 70, "text": 'x,"y"\nz', "none": None, "flag": True, "tiny": 1e-300,
              "nan": float("nan"), "inf": float("-inf"), "t": torch.tensor(7), "arr": np.array([1, 2])}
    logger.log_metrics(values, 10)
    logger.finalize()
    header, rows = read_csv(os.path.join(logger.log_dir, "metrics.csv"))
    assert set(header) == set(names) | set(values) | {"step"} and header == sorted(header)
    for i, name in enumerate(names):
        assert rows[i][name] == repr(float(i)) and rows[i]["step"] == str(i)
    last = rows[-1]
    assert last["int"] == "3" and last["big"] == str(2 ** 70) and last["text"] == 'x,"y"\nz'
    assert last["none"] == "" and last["flag"] == "True" and float(last["tiny"]) == 1e-300
    assert last["nan"] == "nan" and last["inf"] == "-inf" and last["t"] == "7" and last["arr"] == "[1 2]"
    assert len(rows) == len(names) + 1


def test_csv_flushes_every_n_steps_even_when_steps_skip(tmp_path):
    logger = CSVLogger(tmp_path, flush_logs_every_n_steps=10)
    path = os.path.join(logger.log_dir, "metrics.csv")
    for step in (0, 4, 8):
        logger.log_metrics({"x": float(step)}, step)
    assert not os.path.exists(path)
    logger.log_metrics({"x": 12.0}, 12)  # past step 9: written, though no step + 1 was a multiple of 10
    assert len(read_csv(path)[1]) == 4
    logger.log_metrics({"x": 13.0}, 13)
    assert len(read_csv(path)[1]) == 4
    logger.save()
    assert len(read_csv(path)[1]) == 5
    steps = CSVLogger(tmp_path, flush_logs_every_n_steps=3)
    for _ in range(3):
        steps.log_metrics({"x": 1.0})  # step None: the rows are numbered
    assert [r["step"] for r in read_csv(os.path.join(steps.log_dir, "metrics.csv"))[1]] == ["0", "1", "2"]


def test_a_metric_named_step_gives_way_to_the_step_column(tmp_path):
    from xtrainer.loggers import base

    base._warned.discard("csv-step")
    logger = CSVLogger(tmp_path)
    with pytest.warns(UserWarning, match="named 'step'"):
        logger.log_metrics({"step": 99.0, "x": 1.0}, 3)
    logger.finalize()
    assert read_csv(os.path.join(logger.log_dir, "metrics.csv"))[1] == [{"step": "3", "x": "1.0"}]


def test_csv_resumed_into_its_folder_appends(tmp_path):
    first = CSVLogger(tmp_path, version=0)
    first.log_metrics({"loss": 1.0, "epoch": 0}, 0)
    first.log_metrics({"loss": 0.5, "epoch": 0}, 1)
    first.finalize()
    again = CSVLogger(tmp_path, version=0)
    again.log_metrics({"loss": 0.25, "epoch": 1}, 2)  # same columns: appended
    again.save()
    again.log_metrics({"loss": 0.125, "val": 3.0, "epoch": 1}, 3)  # a new column: rewritten, rows kept
    again.finalize()
    header, rows = read_csv(os.path.join(again.log_dir, "metrics.csv"))
    assert header == ["epoch", "loss", "step", "val"]
    assert [(r["step"], r["loss"], r["val"]) for r in rows] == [
        ("0", "1.0", ""), ("1", "0.5", ""), ("2", "0.25", ""), ("3", "0.125", "3.0")]


def test_csv_resume_drops_a_last_row_cut_short(tmp_path):
    folder = tmp_path / "lightning_logs" / "version_0"
    folder.mkdir(parents=True)
    (folder / "metrics.csv").write_text('loss,step,"x\ny"\n1.0,0,\n0.5,1,7\n0.2', encoding="utf-8")
    logger = CSVLogger(tmp_path, version=0)
    logger.log_metrics({"loss": 0.4}, 2)
    logger.finalize()
    header, rows = read_csv(folder / "metrics.csv")
    assert header == ["loss", "step", "x\ny"]
    assert [(r["step"], r["loss"], r["x\ny"]) for r in rows] == [("0", "1.0", ""), ("1", "0.5", "7"), ("2", "0.4", "")]


def test_csv_on_a_full_disk_keeps_whole_rows_and_writes_the_rest_later(small_disk):
    disk = small_disk("64k")
    logger = CSVLogger(disk, flush_logs_every_n_steps=1)
    filler = os.path.join(disk, "filler")
    with open(filler, "wb") as f:
        f.write(b"x" * 40 * 1024)
    payload = "y" * 1500
    failed_at = None
    for step in range(200):
        metrics = {"loss": float(step), "blob": payload}
        if step % 5 == 4:
            metrics[f"new_{step}"] = 1.0  # now and then a header rewrite
        try:
            logger.log_metrics(metrics, step)
        except OSError as err:
            assert "could not write" in str(err) and "holds every row written before" in str(err)
            failed_at = step
            break
    assert failed_at is not None, "the disk never filled up"
    rows = read_csv(os.path.join(logger.log_dir, "metrics.csv"))[1]
    assert [r["loss"] for r in rows] == [repr(float(i)) for i in range(len(rows))] and len(rows) <= failed_at
    assert all(r["blob"] == payload for r in rows)
    assert not glob.glob(os.path.join(logger.log_dir, ".tmp-*"))
    os.remove(filler)
    logger.finalize()  # the rows that waited are written now
    rows = read_csv(os.path.join(logger.log_dir, "metrics.csv"))[1]
    assert [r["loss"] for r in rows] == [repr(float(i)) for i in range(failed_at + 1)]


def test_csv_refuses_to_append_to_a_file_that_is_not_csv(tmp_path):
    folder = tmp_path / "lightning_logs" / "version_0"
    folder.mkdir(parents=True)
    (folder / "metrics.csv").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ValueError, match="is not a CSV file"):
        CSVLogger(tmp_path, version=0).log_metrics({"x": 1.0}, 0)
    assert (folder / "metrics.csv").read_bytes() == b"\xff\xfe\x00binary"  # left as it was


class Color(enum.Enum):
    RED = "red"


def test_hparams_yaml_holds_plain_values_only(tmp_path):
    logger = CSVLogger(tmp_path)
    conf = OmegaConf.create({"optim": {"lr": 0.1, "betas": [0.9, 0.99]}, "ref": "${optim.lr}"})
    logger.log_hyperparams({"conf": conf, "ns": argparse.Namespace(a=1), "tuple": (1, (2, 3)), "set": {3, 1},
                            "path": pathlib.Path("/data"), "enum": Color.RED, "np": np.int64(5),
                            "tensor": torch.tensor(0.5), "object": object(), "fn": len, "cls": nn.Linear,
                            "nested": {1: {"deep": [None, True]}}, "weird key\n": "v",
                            "listconf": OmegaConf.create([1, {"a": 2}])})
    logger.log_hyperparams(argparse.Namespace(lr=0.3))  # merged
    logger.log_hyperparams(OmegaConf.create({"missing": "${nope}"}))  # does not resolve: kept as written
    saved = yaml.safe_load(open(os.path.join(logger.log_dir, "hparams.yaml")))
    assert saved["conf"] == {"optim": {"lr": 0.1, "betas": [0.9, 0.99]}, "ref": 0.1}
    assert saved["ns"] == {"a": 1} and saved["tuple"] == [1, [2, 3]] and saved["set"] == [1, 3]
    assert saved["path"] == "/data" and saved["enum"] == "red" and saved["np"] == 5 and saved["tensor"] == 0.5
    assert saved["object"].startswith("<object object") and saved["fn"] == "<built-in function len>"
    assert "Linear" in saved["cls"] and saved["nested"] == {1: {"deep": [None, True]}}
    assert saved["weird key\n"] == "v" and saved["lr"] == 0.3 and saved["missing"] == "${nope}"
    assert saved["listconf"] == [1, {"a": 2}]
    with pytest.raises(TypeError, match="hyperparameters must be"):
        logger.log_hyperparams([1, 2])


KILLED_WRITER = LOAD_LOGGERS + textwrap.dedent("""
    import os
    save_dir, progress = sys.argv[1], sys.argv[2]
    out = os.open(progress, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    logger = xloggers.CSVLogger(save_dir, name="", version=0, flush_logs_every_n_steps=1)
    kill_at_replace = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    if kill_at_replace >= 0:  # die between the temporary file's write and its rename
        real, calls = os.replace, [0]
        def replace(*args):
            calls[0] += 1
            if calls[0] == kill_at_replace:
                os.kill(os.getpid(), 9)
            return real(*args)
        os.replace = replace  # the loggers' module and this script share one os
    os.write(out, b"ready\\n")
    for step in range(10 ** 6):
        metrics = {"loss": step * 0.5, "epoch": step // 10, 'odd, "name"\\n': -step}
        if step % 3 == 0:
            metrics[f"new_{step}"] = float(step)  # a new column: the whole file is rewritten
        logger.log_metrics(metrics, step)  # flushed at once (flush_logs_every_n_steps=1)
        os.write(out, b"%d\\n" % step)
""")


def check_killed_file(folder, progress_file):
    """metrics.csv parses; its rows are steps 0..k in order, each whole; every step the writer
    reported as written is among them."""
    reported = [int(x) for x in pathlib.Path(progress_file).read_text().split()[1:]]
    path = os.path.join(folder, "metrics.csv")
    if not os.path.exists(path):
        assert not reported
        return -1
    header, rows = read_csv(path)
    assert header[0] == "epoch" and "step" in header and "loss" in header
    for i, row in enumerate(rows):
        assert None not in row and None not in row.values(), f"row {i} has a wrong number of fields: {row}"
        assert row["step"] == str(i) and float(row["loss"]) == i * 0.5 and row["epoch"] == str(i // 10)
        assert row['odd, "name"\n'] == str(-i)
        for column in header:
            if column.startswith("new_"):
                assert row[column] == (repr(float(i)) if column == f"new_{i}" else "")
    assert len(rows) >= len(reported), f"written steps lost: {len(rows)} rows, {len(reported)} reported"
    return len(rows) - 1


def run_killed_writer(tmp_path, tag, *extra, delay=None):
    save_dir, progress = tmp_path / tag, tmp_path / f"{tag}.progress"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(save_dir), str(progress), *extra])
    deadline = time.time() + 60
    while not (progress.exists() and progress.read_text().startswith("ready")):
        assert proc.poll() is None and time.time() < deadline, "the writer did not start"
        time.sleep(0.01)
    if delay is not None:
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=subprocess_timeout(60))
    assert proc.returncode == -signal.SIGKILL
    return str(save_dir / "version_0"), str(progress)


def test_csv_killed_at_random_points_keeps_every_written_row(tmp_path):
    rng = random.Random()
    seed = rng.randrange(10 ** 6)
    rng = random.Random(seed)
    last_steps = []
    for i in range(5):
        delay = rng.uniform(0.05, 0.6)
        folder, progress = run_killed_writer(tmp_path, f"run{i}", delay=delay)
        try:
            last_steps.append(check_killed_file(folder, progress))
        except AssertionError as err:
            raise AssertionError(f"seed {seed}, kill after {delay:.3f} s: {err}") from err
    assert max(last_steps) > 10, f"the writer hardly ran: {last_steps} (seed {seed})"


def test_csv_killed_between_a_rewrite_and_its_rename_then_resumed(tmp_path):
    folder, progress = run_killed_writer(tmp_path, "mid", "5")  # killed inside its 5th header rewrite
    last = check_killed_file(folder, progress)
    assert last >= 9 and glob.glob(os.path.join(folder, ".tmp-*-metrics.csv"))  # the unfinished rewrite
    header_before = read_csv(os.path.join(folder, "metrics.csv"))[0]
    assert "new_12" not in header_before  # the rewrite that added it never landed
    resumed = CSVLogger(str(tmp_path / "mid"), name="", version=0, flush_logs_every_n_steps=1)
    resumed.log_metrics({"loss": (last + 1) * 0.5, "epoch": (last + 1) // 10, 'odd, "name"\n': -(last + 1)}, last + 1)
    resumed.log_metrics({"loss": (last + 2) * 0.5, "epoch": (last + 2) // 10, 'odd, "name"\n': -(last + 2),
                         f"new_{last + 2}": float(last + 2)}, last + 2)
    resumed.finalize()
    assert not glob.glob(os.path.join(folder, ".tmp-*"))  # the dead writer's leftover is gone
    rows = read_csv(os.path.join(folder, "metrics.csv"))[1]
    assert [r["step"] for r in rows] == [str(i) for i in range(last + 3)]
    assert rows[-1][f"new_{last + 2}"] == repr(float(last + 2))


# ---- the model summary ------------------------------------------------------------------------------
class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 16)
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32)))
        self.head = nn.Linear(16, 100, bias=False)
        self.head.weight = self.embed.weight  # tied: counted once
        self.frozen = nn.Linear(32, 8)
        self.frozen.requires_grad_(False)
        self.frozen.eval()
        self.scale = nn.Parameter(torch.ones(3))  # on the module itself


def test_summary_counts_every_parameter_once(tmp_path):
    model = Tied()
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    text = summarize(model)
    lines = text.splitlines()
    assert lines[0].split("|")[1:] == [" Name    ", " Type       ", " Params ", " Mode"]
    assert [line.split("|")[1].strip() for line in lines[2:6]] == ["embed", "encoder", "head", "frozen"]
    assert lines[2].startswith("0 | embed ") and "| Embedding  | 1.6 K  | train" in lines[2]
    assert "| Linear     | 264    | eval" in lines[5]
    assert f"{human_readable_count(trainable):<10}Trainable params" in text
    assert f"{human_readable_count(total - trainable):<10}Non-trainable params" in text
    assert f"{human_readable_count(total):<10}Total params" in text
    assert f"{total * 4 / 1e6:,.3f}     Total estimated model params size (MB)" in text
    modes = [m.training for m in model.modules()][1:]
    assert f"{modes.count(True):<10}Modules in train mode" in text
    assert f"{modes.count(False):<10}Modules in eval mode" in text
    assert "per replica" not in text


def test_summary_depth(tmp_path):
    model = Tied()
    names = lambda text: [l.split("|")[1].strip() for l in text.splitlines()[2:] if "|" in l and l[:1].isdigit()]
    assert names(summarize(model, max_depth=2)) == ["embed", "encoder", "encoder.0", "encoder.1", "encoder.2",
                                                    "head", "frozen"]
    assert names(summarize(model, max_depth=-1)) == [n for n, _ in model.named_modules() if n]
    none = summarize(model, max_depth=0)
    assert none.splitlines()[0].endswith("Trainable params") and "|" not in none
    for bad in (-2, 1.5, True):
        with pytest.raises(ValueError, match="max_depth"):
            summarize(model, max_depth=bad)
    with pytest.raises(TypeError, match="nn.Module"):
        summarize(object())


def test_summary_per_replica_size_when_sharded():
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 3))  # 110 + 33 parameters
    text = summarize(model, world_size=4, sharded=True)
    per_replica = (28 + 3 + 9 + 1) * 4  # each parameter split in 4, rounded up
    assert f"{per_replica / 1e6:,.3f}     Estimated params size per replica (MB), sharded over 4 replicas" in text
    assert "143       Total params" in text  # whole counts
    assert "per replica" not in summarize(model, world_size=4)  # DDP: every replica holds it all
    with pytest.raises(ValueError, match="world_size"):
        summarize(model, world_size=0, sharded=True)


def test_summary_of_a_module_fsdp_has_sharded_counts_it_whole():
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel

    from xtrainer import _xla

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Sequential(nn.Linear(16, 4), nn.Linear(4, 1)))
    before = summarize(model, max_depth=-1)
    model = model.to(_xla.device())
    model[2] = XlaFullyShardedDataParallel(model[2])  # a nested unit, then the root
    wrapped = XlaFullyShardedDataParallel(model)
    assert len(list(model.parameters())) < 6  # FSDP took the parameters away from their modules
    after = summarize(model, max_depth=1, world_size=1, sharded=True)
    for line in ("217       Total params", "217       Trainable params", "0.001     Total estimated"):
        assert line in before and line in after
    assert "| 2    | XlaFullyShardedDataParallel | 73     | train" in after
    del wrapped


def test_human_readable_counts():
    assert [human_readable_count(n) for n in (0, 999, 1000, 1234, 99_999, 100_000, 87_500_000, 2 * 10 ** 12,
                                              5 * 10 ** 16)] == [
        "0", "999", "1.0 K", "1.2 K", "100.0 K", "100 K", "87.5 M", "2.0 T", "50,000 T"]


# ---- with the Trainer ------------------------------------------------------------------------------
wired = pytest.mark.skipif("claim_run_folder" not in inspect.getsource(xtrainer.trainer),
                           reason="trainer.py does not claim its run folder through xtrainer.loggers yet")


@wired
def test_trainer_writes_both_loggers_into_one_lightning_folder(tmp_path):
    tb, csv_logger = TensorBoardLogger(tmp_path / "logs"), CSVLogger(tmp_path / "logs", flush_logs_every_n_steps=4)
    trainer = Trainer(max_epochs=2, log_every_n_steps=2, default_root_dir=str(tmp_path / "root"),
                      enable_progress_bar=False, enable_model_summary=False, logger=[tb, csv_logger])
    assert trainer.logger is tb and trainer.loggers == [tb, csv_logger]
    trainer.fit(Regressor(), make_loader(), make_loader(n=16, seed=1))
    folder = str(tmp_path / "logs" / "lightning_logs" / "version_0")
    assert trainer.log_dir == tb.log_dir == csv_logger.log_dir == folder
    assert os.path.exists(os.path.join(folder, "checkpoints", "last.ckpt"))
    header, rows = read_csv(os.path.join(folder, "metrics.csv"))
    assert {"epoch", "step", "train_loss_step", "train_loss_epoch", "val_loss"} <= set(header)
    assert [r["val_loss"] != "" for r in rows].count(True) == 2 and rows[-1]["epoch"] == "1"
    assert {"train_loss_step", "val_loss", "hp_metric"} <= set(SummaryReader(folder).scalars.tag)
    view, view_metrics = hparams_view(folder)
    assert view["trainer/max_epochs"] == 2 and "val_loss" in view_metrics  # the run's settings are shown
    assert yaml.safe_load(open(os.path.join(folder, "hparams.yaml"))) == {}  # the module saved none
    again = Trainer(max_epochs=3, default_root_dir=str(tmp_path / "root"), enable_progress_bar=False,
                    enable_model_summary=False, logger=CSVLogger(tmp_path / "logs"))
    again.fit(Regressor(), make_loader(), ckpt_path="last")  # found in the logger's lineage
    assert again.log_dir.endswith(os.path.join("lightning_logs", "version_1")) and again.global_step == 24


@wired
def test_trainer_logger_true_keeps_the_run_folder_under_default_root_dir(tmp_path):
    trainer = Trainer(max_steps=2, default_root_dir=str(tmp_path), enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False)
    assert trainer.logger.save_dir == str(tmp_path) and trainer.logger.name == ""
    trainer.fit(Regressor(), make_loader())
    assert trainer.log_dir == str(tmp_path / "version_0") == trainer.logger.log_dir


@wired
def test_trainer_resumed_into_a_named_version_appends_to_its_csv(tmp_path):
    def run(max_steps, **kwargs):
        trainer = Trainer(max_steps=max_steps, log_every_n_steps=2, default_root_dir=str(tmp_path),
                          enable_progress_bar=False, enable_model_summary=False,
                          logger=CSVLogger(name="exp", version="baseline", flush_logs_every_n_steps=1))
        trainer.fit(Regressor(), make_loader(), **kwargs)
        return trainer

    first = run(4)
    assert first.log_dir == str(tmp_path / "exp" / "baseline")
    before = read_csv(os.path.join(first.log_dir, "metrics.csv"))[1]
    again = run(8, ckpt_path="last")  # the checkpoint in exp/baseline/checkpoints is found
    assert again.log_dir == first.log_dir and again.global_step == 8
    assert os.path.realpath(again.ckpt_path).startswith(os.path.realpath(first.log_dir))  # resumed, not restarted
    rows = read_csv(os.path.join(again.log_dir, "metrics.csv"))[1]
    assert rows[:len(before)] == before and len(rows) > len(before)
    assert int(rows[-1]["step"]) == 7  # the epoch's end after step 8, at Lightning's step


def test_rows_of_validate_and_test_after_a_fit_carry_the_epoch_as_lightnings_do(tmp_path):
    logger = CSVLogger(tmp_path)
    trainer = Trainer(max_epochs=2, logger=logger, enable_progress_bar=False, enable_checkpointing=False,
                      default_root_dir=str(tmp_path))
    model = Regressor()
    trainer.fit(model, make_loader())
    trainer.validate(model, make_loader(n=16, seed=1))
    with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    validated = [row for row in rows if row.get("val_loss")]
    assert validated and validated[-1]["epoch"] not in ("", None)
    assert float(validated[-1]["epoch"]) == trainer.current_epoch


class _Sized(Regressor):
    def __init__(self, width: int = 4, lr: float = 0.05) -> None:
        super().__init__(lr=lr)
        self.save_hyperparameters()


class _SizedData(XDataModule):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self):
        return make_loader(batch_size=self.hparams.batch_size)


@wired
@pytest.mark.parametrize("kind", ["tensorboard", "csv"])
def test_hparams_yaml_rebuilds_the_module_as_in_lightning(tmp_path, kind):
    """``hparams.yaml`` holds the module's and the data module's hyperparameters alone (the
    Trainer's settings go to TensorBoard's HPARAMS view only), so ``Model(**yaml)`` works."""
    logger = TensorBoardLogger(tmp_path) if kind == "tensorboard" else CSVLogger(tmp_path)
    trainer = Trainer(strategy="native", max_epochs=1, default_root_dir=str(tmp_path), enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, logger=logger)
    trainer.fit(_Sized(width=6), datamodule=_SizedData(batch_size=16))
    saved = yaml.safe_load(open(os.path.join(logger.log_dir, "hparams.yaml")))
    assert saved == {"width": 6, "lr": 0.05, "batch_size": 16}
    saved.pop("batch_size")
    assert _Sized(**saved).hparams == {"width": 6, "lr": 0.05}
    if kind == "tensorboard":
        view, _ = hparams_view(logger.log_dir)
        assert view["width"] == 6 and view["trainer/strategy"] == "native"
