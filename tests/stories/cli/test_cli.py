"""The configuration loader and the ``xtrainer`` command: merge order, error messages, round trip."""

import os
import subprocess
import sys

import conftest
import pytest
import torch
import yaml

from xtrainer.launch import cli
from xtrainer.config import RunConfig, load, save_config

TESTS = os.path.dirname(os.path.abspath(conftest.__file__))
BASE = """
seed: 3
model:
  _target_: conftest.Regressor
  lr: 0.05
data:
  _target_: conftest.RegressionData
  batch_size: 8
trainer:
  max_epochs: 1
  enable_progress_bar: false
  logger: false
"""


@pytest.fixture
def base(tmp_path, monkeypatch):
    monkeypatch.chdir(TESTS)  # targets are imported from the current folder, as `python -m` would
    path = tmp_path / "base.yaml"
    path.write_text(BASE + f"  default_root_dir: {tmp_path / 'runs'}\n")
    return str(path)


def test_defaults_then_files_in_order_then_overrides(base, tmp_path, monkeypatch):
    second = tmp_path / "second.yaml"
    second.write_text("model:\n  lr: 0.2\ntrainer:\n  max_epochs: 4\n  log_every_n_steps: ${trainer.max_epochs}\n"
                      "  default_root_dir: ${oc.env:XT_RUNS}\n")
    monkeypatch.setenv("XT_RUNS", str(tmp_path / "from-env"))
    config = load(["--config", base, "--config", str(second), "trainer.max_epochs=6", "strategy=xla_ddp"])
    assert isinstance(config, RunConfig)
    assert config.model == {"_target_": "conftest.Regressor", "lr": 0.2}  # the second file wins over the first
    assert config.trainer.max_epochs == 6 and config.trainer.log_every_n_steps == 6  # override, interpolated
    assert config.trainer.default_root_dir == str(tmp_path / "from-env")
    assert config.trainer.accumulate_grad_batches == 1 and config.seed == 3  # a default, a first-file value
    assert config.strategy == "xla_ddp"


@pytest.mark.parametrize("items, message", [
    (["trainer.max_epoch=3"], "Unknown key 'trainer.max_epoch'. Did you mean 'trainer.max_epochs'?"),
    (["trainer.max_epochs=many"], "trainer.max_epochs='many' is not a valid int"),
    (["model.lrr=0.1"], "Unknown key 'model.lrr': conftest.Regressor takes lr, optimizer. Did you mean 'lr'?"),
    (["model.lr=fast"], "model.lr='fast' is not a valid float"),
    (["model._target_=conftest.Regresor"], "module conftest has no attribute 'Regresor'"),
    (["model._target_=nowhere.Model"], "no module 'nowhere' can be imported"),
    (["data._target_=torch.utils.data.DataLoader"], "data._target_='torch.utils.data.DataLoader' is refused: a "
                                                    "_target_ names a class of the type its place expects, here an "
                                                    "XDataModule subclass"),
    (["strategy=xla_fdsp"], "strategy: Unknown strategy 'xla_fdsp'. Did you mean 'xla_fsdp'?"),
    (["strategy.name=xla_fsdp", "strategy.reshard=false"], "takes an argument 'reshard'. Did you mean "
                                                           "'reshard_after_forward'?"),
    (["callbacks=[{_target_: xtrainer.callbacks.EarlyStopping}]"], "callbacks[0].monitor is required"),
    (["trainer.detect_nonfinite=skip"], "detect_nonfinite='skip': use 'raise', 'warn' or 'off'"),
    (["data.batch_size=0"], "data: RegressionData.train_dataloader() failed: batch_size should be a positive"),
    (["trainer.limit_train_batches=0"], "trainer.limit_train_batches=0 leaves no batches to fit"),
    (["model._target_=os.system", "model.command=true"], "model._target_='os.system' is refused: a _target_ names "
                                                         "a class"),
    (["--epochs", "3"], "Unexpected argument '--epochs'"),
    (["strategy=xla_ddp", "trainer.strategy=xla_fsdp"], "Both strategy and trainer.strategy are set"),
    (["trainer.strategy={name:xla_fsdp}"], "has a key 'name:xla_fsdp': YAML needs a space after the colon"),
    (["trainer.logger={_target_: os.system, command: true}"], "trainer.logger._target_='os.system' is refused"),
    (["trainer.callbacks=[{_target_: xtrainer.callbacks.EarlyStopping}]"], "trainer.callbacks[0].monitor is required"),
])
def test_mistakes_are_one_line_messages_and_exit_code_2(base, capsys, items, message):
    assert cli.main(["fit", "--config", base, *items]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.startswith("xtrainer fit: error: ")


def test_missing_model_and_missing_file(tmp_path, capsys):
    assert cli.main(["fit"]) == 2
    assert "model is required and has no value" in capsys.readouterr().err
    assert cli.main(["config", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_config_prints_the_resolved_configuration(base, capsys):
    assert cli.main(["config", "--config", base, "trainer.max_epochs=9"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["max_epochs"] == 9 and printed["trainer"]["precision"] == "32"  # defaults too
    assert printed["model"]["_target_"] == "conftest.Regressor"


def test_a_saved_config_reproduces_the_run(base, tmp_path, capsys):
    assert cli.main(["fit", "--config", base, "model.optimizer=adam", "strategy={name: xla_ddp, bucket_cap_mb: 10}"]) == 0
    (run,) = [d for d in os.listdir(tmp_path / "runs")]
    saved = tmp_path / "runs" / run / "config.yaml"
    assert load(["--config", str(saved)]) == load(["--config", base, "model.optimizer=adam",
                                                   "strategy={name: xla_ddp, bucket_cap_mb: 10}"])
    assert "val_loss" in capsys.readouterr().out  # the final metrics are printed
    first = torch.load(os.path.realpath(tmp_path / "runs" / run / "checkpoints" / "last.ckpt"))
    assert cli.main(["fit", "--config", str(saved)]) == 0
    second_run = sorted(os.listdir(tmp_path / "runs"))[-1]
    second = torch.load(os.path.realpath(tmp_path / "runs" / second_run / "checkpoints" / "last.ckpt"))
    for name, tensor in first["state_dict"].items():
        assert torch.equal(tensor, second["state_dict"][name]), name  # same seed, same run


def test_save_config_writes_what_load_reads(tmp_path, base):
    config = load(["--config", base])
    path = save_config(config, tmp_path / "out")
    assert load(["--config", path]) == config


def test_xtrainer_fit_then_validate_from_the_command_line(base, tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "xtrainer")
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    fit = subprocess.run([exe, "fit", "--config", base, "trainer.max_epochs=2"], capture_output=True, text=True,
                         cwd=TESTS, env=env)
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert "run folder" in fit.stdout and "val_loss:" in fit.stdout
    val = subprocess.run([exe, "validate", "--config", base, "ckpt_path=last"], capture_output=True, text=True,
                         cwd=TESTS, env=env)
    assert val.returncode == 0, val.stderr[-3000:]
    assert "dataloader 0: val_loss=" in val.stdout
    helped = subprocess.run([exe, "fit", "--help"], capture_output=True, text=True, env=env)
    assert helped.returncode == 0 and "--config FILE.yaml" in helped.stdout
