"""A configuration names classes, never arbitrary callables: every ``_target_`` is checked before
anything is built, and every config mistake is one line on stderr with exit code 2."""

import os
import subprocess
import sys

import pytest
import yaml

import xtrainer
from xtrainer import cli
from xtrainer import config as cfg_io
from xtrainer.config import ConfigError, call_checked, load, locate, save_config

TESTS = os.path.dirname(os.path.abspath(__file__))
BASE = {
    "seed": 3,
    "model": {"_target_": "conftest.Regressor", "lr": 0.05},
    "data": {"_target_": "conftest.RegressionData", "batch_size": 8},
    "trainer": {"max_epochs": 1, "enable_progress_bar": False, "logger": False},
}


@pytest.fixture
def write(tmp_path, monkeypatch):
    """``write(**changes)``: the path of a config file, BASE with ``changes`` merged in."""
    monkeypatch.chdir(TESTS)  # targets are imported from the current folder, as `python -m` would

    def write(text=None, **changes):
        path = tmp_path / f"run{len(list(tmp_path.glob('run*.yaml')))}.yaml"
        if text is None:
            config = {**BASE, **changes}
            config["trainer"] = {**config["trainer"], "default_root_dir": str(tmp_path / "runs")}
            text = yaml.safe_dump(config)
        path.write_text(text)
        return str(path)

    return write


@pytest.fixture
def nothing_built(monkeypatch):
    """Fails the test if a Trainer or any ``_target_`` is constructed."""
    built = []
    monkeypatch.setattr(cfg_io, "call_checked", lambda *a, **k: built.append(a) or pytest.fail(f"built {a}"))
    monkeypatch.setattr(xtrainer, "Trainer", lambda *a, **k: built.append(k) or pytest.fail("built a Trainer"))
    yield
    assert not built


def one_line_error(err: str) -> str:
    assert err.startswith("xtrainer fit: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_os_system_in_a_config_is_refused_by_the_real_command(write, tmp_path):
    marker = tmp_path / "MARKER"
    path = write(model={"_target_": "os.system", "command": f"touch {marker}"})
    exe = os.path.join(os.path.dirname(sys.executable), "xtrainer")
    done = subprocess.run([exe, "fit", "--config", path], capture_output=True, text=True, cwd=TESTS,
                          env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert done.returncode == 2, done.stderr[-3000:]
    assert one_line_error(done.stderr) and "model._target_='os.system' is refused" in done.stderr
    assert "names a class" in done.stderr and not marker.exists()


@pytest.mark.parametrize("key, spec, message", [
    ("model", {"_target_": "os.system", "command": "touch {marker}"}, "model._target_='os.system' is refused"),
    ("model", {"_target_": "subprocess.call", "args": ["touch", "{marker}"]}, "'subprocess.call' is refused"),
    ("model", {"_target_": "builtins.eval", "source": "open('{marker}', 'w')"}, "'builtins.eval' is refused"),
    ("model", {"_target_": "subprocess.Popen", "args": ["touch", "{marker}"]}, "'subprocess.Popen' is refused"),
    ("data", {"_target_": "shutil.rmtree", "path": "{tmp}"}, "data._target_='shutil.rmtree' is refused"),
    ("data", {"_target_": "conftest.os.system", "command": "touch {marker}"}, "reaches the module os"),
    ("data", {"_target_": "conftest.make_data"}, "'conftest.make_data' is a function, not a class"),
    ("data", {"_target_": "conftest.Regressor.training_step"}, "is a function, not a class"),
    ("data", {"_target_": "os.system; touch {marker}"}, "is not a dotted class name"),
    ("callbacks", [{"_target_": "xtrainer.callbacks.EarlyStopping", "monitor": "val_loss"},
                   {"_target_": "os.system", "command": "touch {marker}"}], "callbacks[1]._target_='os.system'"),
    ("callbacks", [{"_target_": "xtrainer.callbacks.EarlyStopping", "monitor": "val_loss",
                    "mode": {"_target_": "subprocess.call", "args": ["touch", "{marker}"]}}],
     "callbacks[0].mode._target_='subprocess.call' is refused"),
])
def test_a_target_that_is_not_an_allowed_class_is_refused_before_anything_is_built(
        write, tmp_path, capsys, nothing_built, key, spec, message):
    marker = tmp_path / "MARKER"
    spec = yaml.safe_load(yaml.safe_dump(spec).replace("{marker}", str(marker)).replace("{tmp}", str(tmp_path)))
    assert cli.main(["fit", "--config", write(**{key: spec})]) == 2
    err = one_line_error(capsys.readouterr().err)
    assert message in err, err
    assert not marker.exists() and tmp_path.exists()


def test_replaying_an_edited_saved_config_is_refused(write, tmp_path, capsys, nothing_built):
    saved = save_config(load(["--config", write()]), tmp_path / "runs" / "version_0")
    marker = tmp_path / "MARKER"
    edited = yaml.safe_load(open(saved))
    edited["model"] = {"_target_": "os.system", "command": f"touch {marker}"}
    with open(saved, "w") as f:
        yaml.safe_dump(edited, f)
    assert cli.main(["fit", "--config", saved]) == 2
    assert "model._target_='os.system' is refused" in one_line_error(capsys.readouterr().err)
    assert not marker.exists()


@pytest.mark.parametrize("text, message", [
    ("model: !!python/object:os.system {}\n", "line 1, column 8: the YAML tag '!!python/object:os.system' is not"),
    ("model:\n  _target_: !!python/name:os.system ''\n", "line 2, column 13: the YAML tag '!!python/name:os.system'"),
    ("model: !!python/object/apply:os.system ['touch {marker}']\n", "'!!python/object/apply:os.system' is not allowed"),
    ("model:\n  _target_: [conftest.Regressor,\n", "line 3, column 1: invalid YAML: did not find expected node"),
    ("- model\n- data\n", "a config file holds a mapping of keys"),
])
def test_yaml_tags_and_syntax_errors_are_one_line_messages(write, tmp_path, capsys, nothing_built, text, message):
    marker = tmp_path / "MARKER"
    path = write(text.replace("{marker}", str(marker)))
    assert cli.main(["fit", "--config", path]) == 2
    err = one_line_error(capsys.readouterr().err)
    assert message in err and (f"{path!r}, line" in err or "mapping" in err), err
    assert not marker.exists()


def test_a_tag_in_an_override_is_refused(write, capsys, nothing_built):
    assert cli.main(["fit", "--config", write(), "model.lr=!!python/name:os.system"]) == 2
    assert "'model.lr=!!python/name:os.system': the YAML tag" in one_line_error(capsys.readouterr().err)


@pytest.mark.parametrize("dotted", [
    "os.system", "os.path.join", "posixpath.join", "subprocess.Popen", "builtins.type", "builtins.open",
    "shutil.rmtree", "importlib.import_module", "sys.exit", "pickle.loads", "marshal.loads", "ctypes.CDLL",
    "socket.socket", "pty.spawn", "runpy.run_path", "code.InteractiveConsole", "multiprocessing.Process",
    "signal.raise_signal", "io.FileIO", "_io.FileIO", "pathlib.Path", "tempfile.TemporaryDirectory",
    "logging.FileHandler", "xtrainer.config.importlib.import_module", "conftest.torch.load", "conftest.os",
    "conftest.Regressor.__init__", "os", "", None, 3, "conftest..Regressor",
])
def test_locate_gives_classes_only(dotted):
    with pytest.raises(ConfigError, match=r"^model\._target_=.*(class|refused|reaches the module)"):
        locate(dotted, "model")


def test_locate_accepts_classes_and_call_checked_refuses_callables(monkeypatch):
    monkeypatch.chdir(TESTS)
    from xtrainer.callbacks import EarlyStopping

    assert locate("xtrainer.callbacks.EarlyStopping", "callbacks[0]") is EarlyStopping
    assert locate("torch.utils.data.DataLoader", "data").__name__ == "DataLoader"
    with pytest.raises(ConfigError, match="is a builtin function, not a class"):
        call_checked(print, {}, "model")
    with pytest.raises(ConfigError, match="is a class from subprocess, which is refused"):
        call_checked(subprocess.Popen, {"args": ["true"]}, "model")


@pytest.mark.parametrize("items, message", [
    (["data._target_=torch.utils.data.DataLoader", "data.dataset=[1, 2]", "data.batch_size=0"],
     "data: batch_size should be a positive integer value"),
    (["data.batch_size=-2"], "data: RegressionData.train_dataloader() failed: batch_size should be a positive"),
    (["trainer.limit_train_batches=0.0"], "trainer.limit_train_batches=0.0 leaves no batches to fit"),
    (["trainer.limit_train_batches=-1"], "trainer: limit_train_batches=-1 must not be negative"),
])
def test_sizes_and_limits_that_leave_nothing_are_one_line_messages(write, capsys, items, message):
    assert cli.main(["fit", "--config", write(), *items]) == 2
    assert message in one_line_error(capsys.readouterr().err)
