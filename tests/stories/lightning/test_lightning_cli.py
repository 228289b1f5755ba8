"""Scripts written with Lightning's ``LightningCLI`` run with their imports changed: subcommands,
config files and overrides, ``--optimizer``/``--lr_scheduler``, the saved ``config.yaml`` that
runs the same fit again, and a config's ``class_path`` admitted only where its type allows."""

import os
import signal
import subprocess
import sys

import conftest
import pytest
import torch
import yaml
from conftest import Regressor, subprocess_timeout
from torch import nn
from lightning_cli_run import Data

from xtrainer.callbacks import EarlyStopping
from xtrainer.cli import LightningCLI, OptimizerCallable, ReduceLROnPlateau, SaveConfigCallback

HERE = os.path.dirname(os.path.abspath(conftest.__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture(autouse=True)
def no_command_line(monkeypatch):
    """LightningCLI parses ``args`` here; pytest's own command line is not the script's."""
    monkeypatch.setattr(sys, "argv", [os.path.join(HERE, "lightning_cli_run.py")])


def _read(path):
    with open(path) as f:
        return f.read()


def quiet(tmp_path, *more):
    return ["--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", *more]


def test_fit_from_the_command_line_saves_a_config_that_runs_the_same_fit_again(tmp_path):
    cli = LightningCLI(Regressor, Data, args=["fit", *quiet(tmp_path / "a"), "--trainer.max_epochs", "2",
                                               "--model.lr", "0.02", "--data.batch_size", "16",
                                               "--seed_everything", "7"])
    assert cli.subcommand == "fit" and cli.trainer.global_step == 8  # 64 samples / 16, two epochs
    assert cli.model.lr == 0.02 and cli.datamodule.batch_size == 16
    saved = os.path.join(cli.trainer.log_dir, "config.yaml")
    config = yaml.safe_load(_read(saved))
    assert config["model"] == {"lr": 0.02, "optimizer": "sgd"} and config["seed_everything"] == 7
    assert config["trainer"]["max_epochs"] == 2
    again = LightningCLI(Regressor, Data, args=["fit", "--config", saved,
                                                 "--trainer.default_root_dir", str(tmp_path / "b")])
    assert again.trainer.global_step == 8
    for a, b in zip(cli.model.state_dict().values(), again.model.state_dict().values()):
        assert torch.equal(a, b)


def test_a_random_seed_is_drawn_and_recorded_for_the_run_to_repeat(tmp_path):
    cli = LightningCLI(Regressor, Data, args=["fit", *quiet(tmp_path / "a"), "--trainer.max_steps", "3"])
    seed = yaml.safe_load(_read(os.path.join(cli.trainer.log_dir, "config.yaml")))["seed_everything"]
    assert isinstance(seed, int) and not isinstance(seed, bool)
    again = LightningCLI(Regressor, Data, args=["fit", *quiet(tmp_path / "b"), "--trainer.max_steps", "3",
                                                 "--seed_everything", str(seed)])
    for a, b in zip(cli.model.state_dict().values(), again.model.state_dict().values()):
        assert torch.equal(a, b)


def test_optimizer_and_scheduler_from_the_command_line_replace_configure_optimizers(tmp_path):
    with pytest.warns(UserWarning, match="Regressor.configure_optimizers is replaced by the --optimizer given"):
        cli = LightningCLI(Regressor, Data, run=False,
                           args=[*quiet(tmp_path), "--trainer.max_epochs", "1", "--optimizer", "Adam", "--optimizer.lr", "0.003",
                                 "--lr_scheduler", "StepLR", "--lr_scheduler.step_size", "2"])
    assert cli.trainer.global_step == 0  # run=False: built, not run
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    optimizer, scheduler = cli.trainer.optimizers[0], cli.trainer.lr_scheduler_configs[0].scheduler
    assert type(optimizer) is torch.optim.Adam and optimizer.defaults["lr"] == 0.003
    assert type(scheduler) is torch.optim.lr_scheduler.StepLR and scheduler.step_size == 2


def test_reduce_lr_on_plateau_from_the_command_line_watches_the_metric_it_names(tmp_path):
    cli = LightningCLI(Regressor, Data, args=[
        "fit", *quiet(tmp_path), "--trainer.max_epochs", "2", "--optimizer", "SGD", "--optimizer.lr", "0.01",
        "--lr_scheduler", "ReduceLROnPlateau", "--lr_scheduler.monitor", "val_loss", "--lr_scheduler.patience", "0"])
    (config,) = cli.trainer.lr_scheduler_configs
    assert type(config.scheduler) is ReduceLROnPlateau and config.monitor == "val_loss"
    assert config.scheduler.patience == 0 and config.scheduler.best < float("inf")  # it read val_loss


class Injected(Regressor):
    """Lightning's dependency injection: the optimizer's class and arguments from the config."""

    def __init__(self, optimizer: OptimizerCallable = torch.optim.Adam):
        super().__init__()
        self.make_optimizer = optimizer

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters())


def test_an_injected_optimizer_and_lightnings_env_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("PL_FIT__TRAINER__MAX_STEPS", "2")  # Lightning's prefix, with default_env
    cli = LightningCLI(Injected, Data, parser_kwargs={"default_env": True}, auto_configure_optimizers=False,
                       args=["fit", *quiet(tmp_path), "--model.optimizer", "SGD", "--model.optimizer.lr", "0.25"])
    assert cli.trainer.global_step == 2
    (optimizer,) = cli.trainer.optimizers
    assert type(optimizer) is torch.optim.SGD and optimizer.defaults["lr"] == 0.25


def test_callbacks_from_a_config_and_the_subcommands_after_fit(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "trainer": {"max_epochs": 1, "callbacks": [
            {"class_path": "xtrainer.callbacks.EarlyStopping", "init_args": {"monitor": "val_loss", "patience": 5}}],
            "logger": [{"class_path": "CSVLogger", "init_args": {"save_dir": str(tmp_path / "fit")}},
                       {"class_path": "TensorBoardLogger", "init_args": {"save_dir": str(tmp_path / "fit")}}]},
        "model": {"lr": 0.01}}))
    cli = LightningCLI(Regressor, Data, args=["fit", "--config", str(config), *quiet(tmp_path / "fit")])
    stops = [cb for cb in cli.trainer.callbacks if isinstance(cb, EarlyStopping)]
    assert len(stops) == 1 and stops[0].patience == 5
    assert [type(logger).__name__ for logger in cli.trainer.loggers] == ["CSVLogger", "TensorBoardLogger"]
    assert any(isinstance(cb, SaveConfigCallback) for cb in cli.trainer.callbacks)
    last = os.path.join(cli.trainer.log_dir, "checkpoints", "last.ckpt")
    test = LightningCLI(Regressor, Data, args=["test", *quiet(tmp_path / "test"), "--ckpt_path", last])
    assert test.subcommand == "test" and "test_loss" in test.trainer.callback_metrics


class Sized(Regressor):
    def __init__(self, hidden: int = 16, lr: float = 0.05):
        super().__init__(lr=lr)
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def test_a_checkpoint_given_to_a_subcommand_gives_the_module_its_saved_arguments(tmp_path):
    """As Lightning's: test --ckpt_path builds the module with the hyperparameters it was trained
    with (hidden=32), not the command line's defaults, which would not fit its weights;
    adapt_checkpoint_hparams may change them first."""
    fit = LightningCLI(Sized, Data, args=["fit", *quiet(tmp_path / "fit"), "--trainer.max_steps", "2",
                                           "--model.hidden", "32", "--model.lr", "0.02"])
    last = os.path.join(fit.trainer.log_dir, "checkpoints", "last.ckpt")
    test = LightningCLI(Sized, Data, args=["test", *quiet(tmp_path / "test"), "--ckpt_path", last])
    assert test.model.hparams.hidden == 32 and test.model.lr == 0.02
    assert "test_loss" in test.trainer.callback_metrics

    subclass = LightningCLI(Regressor, Data, subclass_mode_model=True, args=[
        "test", *quiet(tmp_path / "subclass"), "--model", "Sized", "--ckpt_path", last])
    assert type(subclass.model) is Sized and subclass.model.hparams.hidden == 32

    class KeepsTheCommandLinesRate(LightningCLI):
        def adapt_checkpoint_hparams(self, subcommand, checkpoint_hparams):
            checkpoint_hparams.pop("lr")
            return checkpoint_hparams

    adapted = KeepsTheCommandLinesRate(Sized, Data, run=True, args=[
        "test", *quiet(tmp_path / "adapted"), "--ckpt_path", last, "--model.lr", "0.5"])
    assert adapted.model.hparams.hidden == 32 and adapted.model.lr == 0.5


def test_another_runs_config_file_is_not_overwritten_and_a_resumed_run_keeps_its_own(tmp_path):
    """A logger with a fixed version shares one folder between runs: another configuration's
    config.yaml there is refused (as in Lightning), unless overwrite=True; the same configuration
    resumed from its checkpoint is not another run, and goes on."""
    logger = ["--trainer.logger", "xtrainer.loggers.CSVLogger", "--trainer.logger.save_dir", str(tmp_path),
              "--trainer.logger.version", "fixed"]
    args = ["fit", *quiet(tmp_path), *logger, "--trainer.max_steps", "2", "--seed_everything", "1"]
    first = LightningCLI(Regressor, Data, args=args)
    assert first.trainer.log_dir.endswith("fixed")
    with pytest.raises(RuntimeError, match="config.yaml already there: it belongs to a previous run"):
        LightningCLI(Regressor, Data, args=[*args, "--model.lr", "0.01"])
    last = os.path.join(first.trainer.log_dir, "checkpoints", "last.ckpt")
    resumed = LightningCLI(Regressor, Data, args=[*args[:-4], "--trainer.max_steps", "4", "--seed_everything", "1",
                                                   "--ckpt_path", last])
    assert resumed.trainer.global_step == 4
    LightningCLI(Regressor, Data, args=[*args, "--model.lr", "0.01"], save_config_kwargs={"overwrite": True})
    assert yaml.safe_load(_read(os.path.join(first.trainer.log_dir, "config.yaml")))["model"]["lr"] == 0.01


def test_a_class_path_outside_its_places_type_is_refused_and_never_called(tmp_path, capsys):
    """Configurations are data: a callback's class_path must name a Callback; subprocess.Popen
    there is refused at parsing, before anything is built."""
    marker = tmp_path / "ran"
    config = tmp_path / "hostile.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"callbacks": [
        {"class_path": "subprocess.Popen", "init_args": {"args": ["touch", str(marker)]}}]}}))
    with pytest.raises(SystemExit) as exit:
        LightningCLI(Regressor, Data, args=["fit", "--config", str(config), *quiet(tmp_path)])
    assert exit.value.code == 2
    assert "subprocess.Popen" in capsys.readouterr().err
    assert not marker.exists()


@pytest.mark.parametrize("parser_mode", ["yaml", "omegaconf"])
def test_an_alias_bomb_is_refused_at_once_in_both_parser_modes(tmp_path, capsys, parser_mode):
    """Nine levels of aliases of aliases (9**9 strings once expanded): refused as a parse error
    before anything expands them; jsonargparse alone was still expanding after two minutes."""
    text = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n'
    for prev, name in zip("abcdefgh", "bcdefghi"):
        text += f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]\n"
    config = tmp_path / "bomb.yaml"
    config.write_text("trainer:\n  plugins:\n" + "".join(f"    {line}\n" for line in text.splitlines()))
    with pytest.raises(SystemExit) as exit:
        LightningCLI(Regressor, Data, args=["fit", "--config", str(config), *quiet(tmp_path)],
                     parser_kwargs={"parser_mode": parser_mode})
    assert exit.value.code == 2
    assert "its anchors and aliases expand to more than 100,000 values" in capsys.readouterr().err


class Untyped(Regressor):
    def __init__(self, lr: float = 0.05, extra=None):  # noqa: ANN001 - untyped, as in many Lightning modules
        super().__init__(lr=lr)
        self.extra = extra


def test_a_class_path_where_anything_goes_stays_data(tmp_path):
    """Where an argument takes anything (Trainer's plugins, a module's untyped argument), a
    class_path in the config is kept as the dict it is: numpy.memmap(mode="w+") would have
    truncated the file it names."""
    victim = tmp_path / "precious"
    victim.write_text("precious")
    spec = {"class_path": "numpy.memmap", "init_args": {"filename": str(victim), "mode": "w+", "shape": [1]}}
    config = tmp_path / "hostile.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"plugins": spec}}))
    with pytest.raises(ValueError, match="plugins=...: Lightning's plugins"):
        LightningCLI(Regressor, Data, args=["fit", "--config", str(config), *quiet(tmp_path / "a")])
    config.write_text(yaml.safe_dump({"model": {"extra": spec}, "trainer": {"max_steps": 1}}))
    cli = LightningCLI(Untyped, Data, args=["fit", "--config", str(config), *quiet(tmp_path / "b")])
    assert isinstance(cli.model.extra, dict) and cli.model.extra["class_path"] == "numpy.memmap"  # as data
    assert cli.trainer.global_step == 1
    assert victim.read_text() == "precious"


@pytest.mark.multi_device
def test_a_lightning_cli_script_trains_on_two_processes(tmp_path):
    """The script itself, on native_ddp with two processes: the saved callback reaches them
    pickled (without its parser), rank 0 writes config.yaml."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, os.path.join(HERE, "lightning_cli_run.py"), "fit", *quiet(tmp_path),
                           "--trainer.strategy", "native_ddp", "--trainer.devices", "2", "--trainer.max_epochs", "1",
                           "--seed_everything", "3"], env=env, capture_output=True, text=True, timeout=subprocess_timeout(300))
    assert done.returncode == 0, done.stderr[-3000:]
    (folder,) = [os.path.join(tmp_path, d) for d in os.listdir(tmp_path) if d.startswith("version_")]
    assert yaml.safe_load(_read(os.path.join(folder, "config.yaml")))["trainer"]["devices"] == 2
    assert os.path.isfile(os.path.join(folder, "weights.pt"))


@pytest.mark.parametrize("class_path", ["lightning.pytorch.plugins.environments.SLURMEnvironment",
                                        "xtrainer.plugins.environments.SLURMEnvironment"])
def test_a_slurm_environment_in_the_configs_plugins_is_the_trainers(tmp_path, class_path):
    """A Lightning SLURM config's ``trainer.plugins`` (a class spec, kept as data by the parser):
    the cluster environment it names is built with its arguments, the signal given by name;
    nothing else named there is (``numpy.memmap`` above)."""
    from xtrainer.clusters import SLURMEnvironment

    spec = {"class_path": class_path, "init_args": {"auto_requeue": False, "requeue_signal": "SIGUSR2"}}
    config = tmp_path / "slurm.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"plugins": [spec], "max_steps": 1}}))
    cli = LightningCLI(Regressor, Data, args=["fit", "--config", str(config), *quiet(tmp_path)])
    environment = cli.trainer.cluster_environment
    assert isinstance(environment, SLURMEnvironment)
    assert (environment.auto_requeue, environment.requeue_signal) == (False, signal.SIGUSR2)
    assert cli.trainer.global_step == 1
    spec["init_args"]["requeue_signal"] = "SIGNOPE"
    config.write_text(yaml.safe_dump({"trainer": {"plugins": [spec], "max_steps": 1}}))
    with pytest.raises(ValueError, match="requeue_signal='SIGNOPE'.*give a signal's name"):
        LightningCLI(Regressor, Data, args=["fit", "--config", str(config), *quiet(tmp_path / "b")])
