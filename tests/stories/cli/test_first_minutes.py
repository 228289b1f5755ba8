"""What a new user meets first: the command's start-up, its messages and ``./dev`` (the quick start
and the other pages of the documentation: test_docs.py)."""

import os
import re
import shutil
import subprocess
import sys
import textwrap
import warnings

import conftest
import pytest
from conftest import RegressionData, Regressor

import xtrainer
from xtrainer import XModule, cli

TESTS = os.path.dirname(os.path.abspath(conftest.__file__))
ROOT = os.path.dirname(TESTS)
EXE = os.path.join(os.path.dirname(sys.executable), "xtrainer")
BASE = """
seed: 3
model:
  _target_: test_first_minutes.CountedModel
  lr: 0.05
data:
  _target_: test_first_minutes.CountedData
trainer:
  max_epochs: 1
  enable_progress_bar: false
  logger: false
"""


# --------------------------------------------------------------------------------------------
# Targets for the configurations below: they count their constructions.
# --------------------------------------------------------------------------------------------
BUILT: list[str] = []


class CountedModel(Regressor):
    def __init__(self, lr: float = 0.05, optimizer: str = "sgd") -> None:
        BUILT.append("model")
        super().__init__(lr, optimizer)


class CountedData(RegressionData):
    def __init__(self, n: int = 64, batch_size: int = 8, shuffle: bool = False) -> None:
        BUILT.append("data")
        super().__init__(n, batch_size, shuffle)


class TrainOnlyData:
    """Data with a training loader and nothing else."""

    def __init__(self, batch_size: int = 8) -> None:
        self.batch_size = batch_size

    def train_dataloader(self):
        return RegressionData(batch_size=self.batch_size).train_dataloader()


class NoneData(TrainOnlyData):
    def predict_dataloader(self):
        return None


class NoTestStep(XModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()


class FailingPredictions(Regressor):
    def predict_step(self, batch, batch_idx):
        raise RuntimeError("predict_step failed on purpose")


@pytest.fixture
def base(tmp_path, monkeypatch):
    monkeypatch.chdir(TESTS)
    BUILT.clear()
    path = tmp_path / "base.yaml"
    path.write_text(BASE + f"  default_root_dir: {tmp_path / 'runs'}\n")
    return str(path)


def one_line(err: str, command: str) -> str:
    assert err.startswith(f"xtrainer {command}: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err[len(f"xtrainer {command}: error: "):]


def run_folders(tmp_path) -> list[str]:
    runs = tmp_path / "runs"
    return sorted(os.listdir(runs)) if runs.exists() else []


# --------------------------------------------------------------------------------------------
# Start-up: --help and --version without torch.
# --------------------------------------------------------------------------------------------
_PROBE = textwrap.dedent("""
    import sys
    from xtrainer.launch import cli
    try:
        code = cli.main(sys.argv[1:])
    except SystemExit as exit:
        code = exit.code
    heavy = sorted(m for m in ("torch", "torch_xla", "omegaconf", "numpy") if m in sys.modules)
    print("EXIT", code, "HEAVY", ",".join(heavy) or "-", file=sys.stderr)
""")


@pytest.mark.parametrize("argv, code", [
    (["--help"], 0), (["--version"], 0), (["fit", "--help"], 0), (["consolidate", "--help"], 0),
    (["--version", "fit"], 0), (["fitt"], 2), ([], 2), (["consolidate", "x"], 2), (["--verbose"], 2),
])
def test_help_version_and_argument_errors_import_neither_torch_nor_torch_xla(argv, code):
    done = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, cwd=ROOT,
                          env={k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"})
    assert f"EXIT {code} HEAVY -" in done.stderr, done.stderr[-2000:]
    if code == 2:  # one line (argparse's usage block is not repeated) that says where help is
        (line,) = [x for x in done.stderr.splitlines() if not x.startswith("EXIT")]
        assert line.startswith("xtrainer") and ": error: " in line and "--help" in line


def test_the_installed_command_answers_version_and_help_without_importing_torch():
    version = subprocess.run([EXE, "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stderr == ""
    assert re.fullmatch(r"xtrainer \S+ \(torch \S+, torch_xla \S+, Python 3\.\d+\.\d+\)\n", version.stdout)
    assert version.stdout.startswith(f"xtrainer {xtrainer.__version__} ")
    timed = subprocess.run([sys.executable, "-X", "importtime", "-m", "xtrainer.cli", "--help"],
                           capture_output=True, text=True, cwd=ROOT)
    assert timed.returncode == 0 and "fit the model a configuration describes" in timed.stdout
    imported = {line.split("|")[-1].strip().split(".")[0] for line in timed.stderr.splitlines() if "|" in line}
    assert "xtrainer" in imported and not {"torch", "torch_xla", "omegaconf"} & imported


def test_a_typo_in_the_command_suggests_the_right_one(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["predcit"])
    assert exit.value.code == 2
    assert "Did you mean 'predict'?" in capsys.readouterr().err


def test_importing_xtrainer_is_lazy_and_its_names_still_work():
    probe = "import sys, xtrainer; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert done.stdout.split()[0] == "False", done.stdout + done.stderr[-2000:]
    # In this process torch is loaded already: the names resolve to the modules' objects.
    from xtrainer.datamodule import XDataModule
    from xtrainer.launch.interrupts import TrainingInterrupted
    from xtrainer.module import XModule
    from xtrainer.trainer import Trainer, seed_everything

    assert (xtrainer.Trainer, xtrainer.XModule, xtrainer.XDataModule) == (Trainer, XModule, XDataModule)
    assert (xtrainer.seed_everything, xtrainer.TrainingInterrupted) == (seed_everything, TrainingInterrupted)
    namespace: dict = {}
    exec("from xtrainer import *", namespace)
    assert {name for name in namespace if not name.startswith("__")} | {"__version__"} == set(xtrainer.__all__)
    assert set(xtrainer.__all__) <= set(dir(xtrainer))
    from xtrainer import callbacks

    assert xtrainer.callbacks is callbacks  # subpackages stay reachable from the package, as before
    with pytest.raises(AttributeError, match="module 'xtrainer' has no attribute 'Trainr'"):
        xtrainer.Trainr  # noqa: B018
    with pytest.raises(ImportError):
        exec("from xtrainer import Trainr", {})


# --------------------------------------------------------------------------------------------
# xtrainer config refuses what fit refuses, and builds no model and no data.
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("items", [
    ["model.hiden=10", "trainer.strategy=xla_fdsp", "model.lr=abc"],  # several: the same first one
    ["model.lrr=0.1"],
    ["model.lr=fast"],
    ["model._target_=test_first_minutes.Nowhere"],
    ["model._target_=os.system"],
    ["data.batchsize=3"],
    ["data.batch_size=many"],
    ["trainer.strategy=xla_fdsp"],
    ["strategy=xla_ddp", "trainer.strategy=xla_fsdp"],
    ["trainer.strategy={name: xla_fsdp, reshard: false}"],
    ["trainer.strategy={name: xla_fsdpp}"],
    ["trainer.max_epoch=3"],
    ["trainer.max_epochs=many"],
    ["trainer.precision=16x"],
    ["trainer.devices=0"],
    ["trainer.max_time=soon"],
    ["trainer.detect_nonfinite=skip"],
    ["trainer.limit_train_batches=0"],
    ["trainer.callbacks=[{_target_: xtrainer.callbacks.EarlyStopping}]"],
    ["trainer.callbacks=[{_target_: conftest.RegressionData}]"],
    ["trainer.logger={_target_: os.system, command: true}"],
    ["trainer.logger=maybe"],
    ["--epochs", "3"],
    ["model=null"],
])
def test_config_refuses_each_mistake_as_fit_does_without_building_model_or_data(base, capsys, items):
    assert cli.main(["config", "--config", base, *items]) == 2
    captured = capsys.readouterr()
    from_config = one_line(captured.err, "config")
    assert captured.out == "" and BUILT == []
    assert cli.main(["fit", "--config", base, *items]) == 2
    assert one_line(capsys.readouterr().err, "fit") == from_config


def test_config_prints_a_good_configuration_without_building_model_or_data(base, capsys, tmp_path):
    assert cli.main(["config", "--config", base, "trainer.strategy=xla_ddp", "trainer.devices=2"]) == 0
    out = capsys.readouterr().out
    assert "strategy: xla_ddp" in out and "_target_: test_first_minutes.CountedModel" in out
    assert BUILT == [] and run_folders(tmp_path) == []  # nothing built, no run folder


def test_config_reads_the_example_as_shipped(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(["config", "--config", "examples/digits.yaml"]) == 0
    assert "_target_: examples.digits.DigitsClassifier" in capsys.readouterr().out


def test_unreadable_and_malformed_config_files_are_one_line(tmp_path, capsys):
    locked = tmp_path / "locked.yaml"
    locked.write_text("seed: 1\n")
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {_target_: conftest.Regressor\n")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    os.chmod(locked, 0)
    try:
        cases = [(locked, "cannot be read"), (folder, "cannot be read"), (bad, "invalid YAML"),
                 (binary, "cannot be read")]
        if os.access(locked, os.R_OK):  # root reads anything: the permission case cannot happen
            cases = cases[1:]
        for path, message in cases:
            for command in ("config", "fit"):
                assert cli.main([command, "--config", str(path)]) == 2, path
                assert message in one_line(capsys.readouterr().err, command), path
    finally:
        os.chmod(locked, 0o600)


# --------------------------------------------------------------------------------------------
# validate/test/predict: one line for what the configuration lacks, and no empty run folder.
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command, items, message", [
    ("predict", ["data._target_=test_first_minutes.TrainOnlyData"],
     "nothing to predict on: data (test_first_minutes.TrainOnlyData) has no predict_dataloader(), and the model "
     "(test_first_minutes.CountedModel) has none either. Set data._target_ to a class with a predict_dataloader()"),
    ("validate", ["data._target_=test_first_minutes.TrainOnlyData"], "nothing to validate on: data "),
    ("test", ["data._target_=test_first_minutes.TrainOnlyData"], "has no test_dataloader()"),
    ("fit", ["data=null"], "nothing to fit on: the configuration has no data, and the model "
                           "(test_first_minutes.CountedModel) has no train_dataloader()"),
    ("predict", ["data._target_=test_first_minutes.NoneData"], "NoneData).predict_dataloader() returned None"),
    ("validate", ["model._target_=test_first_minutes.Counted", "model.lr=0.1"], "has no attribute 'Counted'"),
    ("test", ["model._target_=test_first_minutes.NoTestStep"],
     "model: test_first_minutes.NoTestStep has no test_step(self, batch, batch_idx) to test with: add one, or set "
     "model._target_ to a class that has one."),
])
def test_stages_without_their_data_are_one_line_and_leave_no_folder(base, tmp_path, capsys, command, items, message):
    assert cli.main([command, "--config", base, *items]) == 2
    err = one_line(capsys.readouterr().err, command)
    assert message in err and "dataloaders=" not in err
    assert run_folders(tmp_path) == []


def test_evaluating_with_ckpt_path_last_and_no_checkpoint_is_an_error_not_a_warning(base, tmp_path, capsys):
    for command in ("validate", "test", "predict"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert cli.main([command, "--config", base, "ckpt_path=last"]) == 1
        assert not [w for w in caught if "starts from scratch" in str(w.message)]  # a fit's warning, not ours
        err = one_line(capsys.readouterr().err, command)
        assert f"ckpt_path='last': no checkpoint in {tmp_path / 'runs'}" in err and f"to {command}." in err
        assert "Run xtrainer fit with this configuration first" in err
        assert cli.main([command, "--config", base, f"ckpt_path={tmp_path / 'nope.ckpt'}"]) == 1
        assert "does not exist" in one_line(capsys.readouterr().err, command)
    assert run_folders(tmp_path) == []


def test_a_run_that_fails_before_writing_anything_leaves_no_folder(base, tmp_path, capsys):
    with pytest.raises(RuntimeError, match="predict_step failed on purpose"):  # the user's error, as itself
        cli.main(["predict", "--config", base, "model._target_=test_first_minutes.FailingPredictions"])
    assert run_folders(tmp_path) == []
    assert cli.main(["predict", "--config", base]) == 0  # the same configuration otherwise runs
    (folder,) = run_folders(tmp_path)
    assert sorted(os.listdir(tmp_path / "runs" / folder)) == ["config.yaml", "predictions.pt"]


def test_predict_on_the_example_without_its_loader_from_the_real_command(tmp_path):
    done = subprocess.run([EXE, "predict", "--config", "examples/digits.yaml", "ckpt_path=last",
                           f"trainer.default_root_dir={tmp_path / 'runs'}"], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert done.returncode == 2, done.stderr[-3000:]
    err = one_line(done.stderr, "predict")
    assert "DigitsData) has no predict_dataloader()" in err and "data._target_" in err
    assert done.stdout == "" and not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------------------------
# ./dev and the Python it builds .venv with.
# --------------------------------------------------------------------------------------------
_FAKE_PYTHON = """#!/usr/bin/env bash
# A stand-in for python VERSION: answers ./dev's questions without installing anything.
case "$1" in
  -c) echo "VERSION" ;;
  -m) case "$2" in
        venv) mkdir -p "$3/bin" && echo "version = VERSION" > "$3/pyvenv.cfg" && cp "$0" "$3/bin/python" ;;
        pip) echo "pip $*" >> "$(dirname "$0")/../pip.log" ;;
        pytest) shift 2; echo "pytest under VERSION: $*" ;;
      esac ;;
esac
"""


@pytest.fixture
def dev(tmp_path):
    """``dev(*args, python=version, venv_python=version or None)``: ./dev in a copy of the
    repository's script, with stand-in interpreters."""
    shutil.copy(os.path.join(ROOT, "dev"), tmp_path / "dev")
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path / "pyproject.toml")
    bindir = tmp_path / "pythons"
    bindir.mkdir()

    def fake(version: str) -> str:
        path = bindir / f"python{version}"
        path.write_text(_FAKE_PYTHON.replace("VERSION", version))
        path.chmod(0o755)
        return str(path)

    def run(*args, python="3.11", env=None):
        return subprocess.run([str(tmp_path / "dev"), *args], capture_output=True, text=True,
                              env={**os.environ, "PYTHON": fake(python), **(env or {})})

    run.fake, run.venv = fake, tmp_path / ".venv"
    return run


def test_dev_rebuilds_a_venv_made_with_another_python(dev):
    first = dev("test", "-x", python="3.12")
    # two test processes unless the arguments choose: -n 0 runs one; the native strategies' longer
    # files are left to the second environment (./dev test-native)
    native_only = "--ignore-glob=tests/stories/native/test_native*.py"
    assert first.returncode == 0 and f"pytest under 3.12: {native_only} -n 2 --dist loadfile -x" in first.stdout, \
        first.stderr
    assert "creating .venv" in first.stderr and "installing xtrainer" in first.stderr
    again = dev("test", "-n", "0", python="3.12")  # same Python: kept, nothing installed again
    assert again.returncode == 0 and again.stderr == "" and f"pytest under 3.12: {native_only} -n 0\n" in again.stdout
    other = dev("test", python="3.11")
    assert other.returncode == 0 and "pytest under 3.11" in other.stdout
    assert ".venv was built with Python 3.12, not Python 3.11" in other.stderr and "rebuilding it" in other.stderr
    assert "installing xtrainer" in other.stderr  # the new environment gets the package again


def test_dev_rebuilds_a_venv_whose_python_no_longer_runs(dev):
    assert dev("test").returncode == 0
    (dev.venv / "bin" / "python").write_text("#!/bin/sh\nexit 1\n")
    done = dev("test")
    assert done.returncode == 0 and "a Python that no longer runs" in done.stderr and "pytest under 3.11" in done.stdout


def test_dev_refuses_an_old_python_before_building_anything(dev):
    done = dev("example", python="3.9")
    assert done.returncode == 1 and not dev.venv.exists()
    assert "Python 3.9; xtrainer needs Python 3.11 or newer" in done.stderr
    assert dev("test").returncode == 0  # the default afterwards just works: nothing to clean up


def test_dev_installs_what_each_command_needs_once_per_pyproject(dev):
    def installed():
        log = dev.venv / "pip.log"
        lines = log.read_text().splitlines() if log.exists() else []
        log.unlink(missing_ok=True)
        return [line.split(" -e ")[1] for line in lines if " -e " in line]

    docs = dev("docs")
    assert docs.returncode == 0 and "installing xtrainer[docs] and its dependencies" in docs.stderr, docs.stderr
    assert installed() == [".[docs]"]
    (dev.venv / "bin" / "xtrainer").write_text('#!/bin/sh\necho "xtrainer $*"\n')
    (dev.venv / "bin" / "xtrainer").chmod(0o755)
    example = dev("example", "trainer.max_epochs=1")
    assert example.returncode == 0 and example.stdout == "xtrainer fit --config examples/digits.yaml trainer.max_epochs=1\n"
    assert installed() == [".[xla,examples]"]  # the example's needs, no test tooling
    assert "installing xtrainer[xla,examples] into" in example.stderr
    again = dev("example")
    assert again.returncode == 0 and again.stderr == "" and installed() == []
    assert dev("test").returncode == 0 and installed() == [".[test,hf,ft]"]  # what the earlier commands lacked
    assert dev("bench").returncode == 0 and dev("docs").returncode == 0 and installed() == []
    with open(dev.venv.parent / "pyproject.toml", "a") as f:
        f.write("# changed\n")
    assert dev("example").returncode == 0 and installed() == [".[xla,examples]"]  # once per change of pyproject.toml
    assert dev("test").returncode == 0 and installed() == [".[test,hf,docs,ft]"]
    assert dev("example").returncode == 0 and installed() == []


def test_pyproject_extras_keep_the_example_free_of_test_tooling():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    extras = project["project"]["optional-dependencies"]
    names = lambda extra: {re.split(r"[<>=\[ ]", spec)[0].lower() for spec in extras[extra]}  # noqa: E731
    assert not names("examples") & {"pytest", "pytest-xdist", "moto", "s3fs", "tbparse"}
    assert {"mkdocs-material", "mkdocstrings"} <= names("docs")
    dev_script = open(os.path.join(ROOT, "dev")).read()
    assert "ensure_env xla examples;" in dev_script and "ensure_env xla examples test hf docs" in dev_script
    assert names("xla") == {"torch", "torch_xla"} and "torch_xla" not in str(project["project"]["dependencies"])
    # the SPDX form of the license, which setuptools >= 77 reads without a deprecation warning
    assert project["project"]["license"] == "Apache-2.0"
    assert any(re.fullmatch(r"setuptools>=(\d+)", r) and int(r.split(">=")[1]) >= 77
               for r in project["build-system"]["requires"])


def test_dev_help_and_unknown_commands(dev):
    helped = dev("--help")
    assert helped.returncode == 0 and "./dev example" in helped.stdout and helped.stderr == ""
    wrong = dev("exmaple")
    assert wrong.returncode == 2 and "unknown command 'exmaple'" in wrong.stderr


def test_pyproject_and_readme_agree_on_python():
    pyproject = open(os.path.join(ROOT, "pyproject.toml")).read()
    assert re.search(r'^requires-python = ">=3\.11"', pyproject, re.M)
    assert "Python 3.11" in open(os.path.join(ROOT, "README.md")).read()


# --------------------------------------------------------------------------------------------
# Noise: torch.distributed.checkpoint's warnings about xtrainer's own calls are filtered there.
# --------------------------------------------------------------------------------------------
def test_spmd_checkpoint_writes_hide_dcps_noise_and_nothing_else(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from xtrainer.checkpoint import distributed

    said = ["torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to save in a "
            "single process.",
            "The function definition for SavePlanner.set_up_planner has been updated to include the storage_meta "
            "argument. Please update your implementation to include this parameter.",
            "TypedStorage is deprecated. It will be removed in the future and UntypedStorage will be the only "
            "storage class.",
            "something else torch.distributed.checkpoint has to say"]

    def save(state, **kwargs):
        for message in said:
            warnings.warn(message, UserWarning)

    monkeypatch.setattr(dcp, "save", save)
    (tmp_path / distributed.STATE_DIR).mkdir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert distributed._save_state({}, str(tmp_path), 0) == {}
    assert [str(w.message) for w in caught] == said[-1:]
    with warnings.catch_warnings(record=True) as caught:  # outside those calls, nothing is filtered
        warnings.simplefilter("always")
        save({})
    assert len(caught) == len(said)
