"""A configuration names classes of the type each place expects, and nothing else: every
``_target_`` is checked (against its place, or the annotation of the parameter it fills) before
anything in the configuration is built; hostile YAML is one line; secrets are not written; the
commands that read no configuration import nothing from the current folder."""

import hashlib
import os
import subprocess
import sys
import textwrap
from typing import Any, Optional, Union

import conftest
import pytest
import yaml
from conftest import RegressionData, Regressor
from torch import nn

import xtrainer
from xtrainer.launch import cli
from xtrainer.callbacks import Callback
from xtrainer.config import ConfigError, load, plan, save_config
from xtrainer.config.targets import locate, place
from xtrainer.loggers import CSVLogger
from xtrainer.config.redaction import REDACTED, looks_secret, redact

TESTS = os.path.dirname(os.path.abspath(conftest.__file__))
ROOT = os.path.dirname(TESTS)
EXE = os.path.join(os.path.dirname(sys.executable), "xtrainer")
BASE = {
    "seed": 3,
    "model": {"_target_": "conftest.Regressor", "lr": 0.05},
    "data": {"_target_": "conftest.RegressionData", "batch_size": 8},
    "trainer": {"max_epochs": 1, "enable_progress_bar": False, "logger": False},
}


# --------------------------------------------------------------------------------------------
# Targets for the configurations below: each records its construction in BUILT.
# --------------------------------------------------------------------------------------------
BUILT: list[str] = []


class RecordingCallback(Callback):
    def __init__(self, name: str = "callback") -> None:
        BUILT.append(f"callback {name}")


class RecordingLogger(CSVLogger):
    def __init__(self, save_dir: Optional[str] = None) -> None:
        BUILT.append("logger")
        super().__init__(save_dir)


class RecordingData(RegressionData):
    def __init__(self, batch_size: int = 8) -> None:
        BUILT.append("data")
        super().__init__(batch_size=batch_size)


class Part(nn.Module):
    def __init__(self, width: int = 4) -> None:
        BUILT.append("part")
        super().__init__()
        self.width = width


class Parts(Regressor):
    """A model whose parameters take nested ``_target_``s, or say they cannot."""

    def __init__(self, lr: float = 0.05, head: Optional[nn.Module] = None, blocks: Optional[list[nn.Module]] = None,
                 loss: Union[nn.MSELoss, nn.L1Loss, None] = None, anything: Any = None, untyped=None,
                 options: Optional[dict] = None, timeout: Optional[Any] = None, **extra: Any) -> None:
        BUILT.append("model")
        super().__init__(lr)
        self.head, self.blocks, self.loss, self.anything = head, blocks, loss, anything


class SecretModel(Regressor):
    """Keeps what it was given, to show the run gets the real secrets."""

    given: dict = {}

    def __init__(self, lr: float = 0.05, api_token: str = "", endpoint: str = "", label: str = "",
                 max_tokens: int = 0, tokenizer: str = "") -> None:
        super().__init__(lr)
        self.save_hyperparameters()
        SecretModel.given = dict(api_token=api_token, endpoint=endpoint, label=label)


@pytest.fixture(autouse=True)
def clear_built():
    BUILT.clear()
    yield
    BUILT.clear()


@pytest.fixture
def write(tmp_path, monkeypatch):
    """``write(**changes)``: the path of a config file, BASE with ``changes`` merged in."""
    monkeypatch.chdir(TESTS)  # targets are imported from the current folder, as `python -m` would

    def write(text=None, **changes):
        path = tmp_path / f"run{len(list(tmp_path.glob('run*.yaml')))}.yaml"
        if text is None:
            config = {**BASE, **changes}
            config["trainer"] = {**BASE["trainer"], "default_root_dir": str(tmp_path / "runs"),
                                 **changes.get("trainer", {})}
            text = yaml.safe_dump(config)
        path.write_text(text)
        return str(path)

    return write


@pytest.fixture
def no_trainer(monkeypatch):
    """Fails the test if a Trainer is constructed."""
    monkeypatch.setattr(xtrainer, "Trainer", lambda *a, **k: pytest.fail("built a Trainer"))


def one_line_error(err: str, command: str = "fit") -> str:
    assert err.startswith(f"xtrainer {command}: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def snapshot(folder) -> dict:
    """Every file and folder under ``folder`` with its content's digest (None for a folder)."""
    found = {}
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            found[os.path.join(root, d)] = None
        for f in files:
            found[os.path.join(root, f)] = digest(os.path.join(root, f))
    return found


# --------------------------------------------------------------------------------------------
# numpy.memmap(mode="w+") zeroed a file outside the run, even under `xtrainer config`
# --------------------------------------------------------------------------------------------
def memmap(victim) -> dict:
    return {"_target_": "numpy.memmap", "filename": str(victim), "mode": "w+", "shape": [64]}


@pytest.mark.parametrize("key", ["model", "data", "callbacks", "logger", "strategy", "nested"])
@pytest.mark.parametrize("command", ["config", "fit"])
def test_memmap_never_touches_a_file_outside_the_run(write, tmp_path, capsys, no_trainer, command, key):
    victim = tmp_path / "elsewhere" / "precious.bin"
    victim.parent.mkdir()
    victim.write_bytes(os.urandom(256))
    before = digest(victim)
    changes = {"model": {"_target_": "test_config_safety.Parts", "head": memmap(victim)}} if key == "nested" else \
        {"callbacks": [memmap(victim)]} if key == "callbacks" else \
        {"trainer": {"logger": memmap(victim)}} if key == "logger" else \
        {"trainer": {"strategy": memmap(victim)}} if key == "strategy" else {key: memmap(victim)}
    assert cli.main([command, "--config", write(**changes)]) == 2
    err = one_line_error(capsys.readouterr().err, command)
    assert "._target_='numpy.memmap' is refused: a _target_ names a class of the type its place expects" in err
    assert "numpy.memmap is not one" in err
    assert digest(victim) == before and BUILT == []
    assert not (tmp_path / "runs").exists()


def test_memmap_under_the_real_config_command_leaves_the_file_and_the_folders_alone(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    victim = tmp_path / "precious.bin"
    victim.write_bytes(os.urandom(256))
    config = dict(BASE, callbacks=[{"_target_": "xtrainer.callbacks.EarlyStopping", "monitor": "val_loss"},
                                   memmap(victim)])
    config["trainer"] = dict(BASE["trainer"], default_root_dir=str(tmp_path / "runs"))
    (work / "run.yaml").write_text(yaml.safe_dump(config))
    before = snapshot(tmp_path)
    done = subprocess.run([EXE, "config", "--config", "run.yaml"], capture_output=True, text=True, cwd=work,
                          env={**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": os.pathsep.join([ROOT, TESTS])})
    assert done.returncode == 2, done.stderr[-3000:]
    err = one_line_error(done.stderr, "config")
    assert "callbacks[1]._target_='numpy.memmap' is refused" in err and "a Callback subclass" in err
    assert snapshot(tmp_path) == before and done.stdout == ""


# --------------------------------------------------------------------------------------------
# The type each place expects, checked before any class in the configuration is built
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, message", [
    ({"data": {"_target_": "xtrainer.callbacks.EarlyStopping", "monitor": "val_loss"}},
     "data._target_='xtrainer.callbacks.EarlyStopping' is refused: a _target_ names a class of the type its place "
     "expects, here an XDataModule subclass or a class with *_dataloader() methods"),
    ({"data": {"_target_": "xtrainer.loggers.CSVLogger", "save_dir": "{tmp}"}}, "'xtrainer.loggers.CSVLogger' is "
                                                                                 "refused"),
    ({"data": {"_target_": "torch.nn.Linear", "in_features": 1, "out_features": 1}}, "torch.nn.Linear is not one"),
    ({"model": {"_target_": "test_config_safety.RecordingData"}}, "here an XModule subclass"),
    ({"trainer": {"logger": [{"_target_": "test_config_safety.RecordingLogger"},
                             {"_target_": "test_config_safety.RecordingCallback"}]}},
     "trainer.logger[1]._target_='test_config_safety.RecordingCallback' is refused"),
    ({"trainer": {"strategy": {"_target_": "test_config_safety.RecordingCallback"}}}, "here a Strategy subclass"),
    ({"data": {"_target_": "test_config_safety.RecordingData"},
      "model": {"_target_": "test_config_safety.Parts", "blocks": [{"_target_": "test_config_safety.Part"},
                                                                  {"_target_": "xtrainer.loggers.CSVLogger"}]}},
     "model.blocks[1]._target_='xtrainer.loggers.CSVLogger' is refused"),
])
def test_a_class_of_the_wrong_type_is_refused_before_any_class_is_built(write, tmp_path, capsys, no_trainer, changes,
                                                                         message):
    changes = yaml.safe_load(yaml.safe_dump(changes).replace("{tmp}", str(tmp_path)))
    changes.setdefault("callbacks", [{"_target_": "test_config_safety.RecordingCallback", "name": "first"}])
    changes.setdefault("trainer", {}).setdefault("logger", {"_target_": "test_config_safety.RecordingLogger",
                                                            "save_dir": str(tmp_path / "logs")})
    for command in ("fit", "config"):
        assert cli.main([command, "--config", write(**changes)]) == 2
        assert message in one_line_error(capsys.readouterr().err, command)
        assert BUILT == []  # not the callback, the logger, the parts, the model or the data before it
    assert sorted(os.listdir(tmp_path)) == ["run0.yaml", "run1.yaml"]


@pytest.mark.parametrize("key, spec, message", [
    ("model", {"_target_": "os.system", "command": "touch {marker}"},
     "model._target_='os.system' is refused: a _target_ names a class of the type its place expects, here an "
     "XModule subclass"),
    ("model", {"_target_": "subprocess.call", "args": ["touch", "{marker}"]}, "'subprocess.call' is refused"),
    ("model", {"_target_": "builtins.eval", "source": "open('{marker}', 'w')"}, "'builtins.eval' is refused"),
    ("model", {"_target_": "subprocess.Popen", "args": ["touch", "{marker}"]},
     "subprocess is in Python's standard library, which holds none"),
    ("data", {"_target_": "shutil.rmtree", "path": "{tmp}"}, "data._target_='shutil.rmtree' is refused"),
    ("data", {"_target_": "conftest.os.system", "command": "touch {marker}"},
     "conftest.os is the module os, reached through conftest"),
    ("data", {"_target_": "conftest.make_data"}, "conftest.make_data is a function, not a class"),
    ("data", {"_target_": "conftest.Regressor.training_step"}, "is a function, not a class"),
    ("data", {"_target_": "os.system; touch {marker}"}, "is not a dotted class name"),
    ("callbacks", [{"_target_": "xtrainer.callbacks.EarlyStopping", "monitor": "val_loss"},
                   {"_target_": "os.system", "command": "touch {marker}"}], "callbacks[1]._target_='os.system'"),
    ("callbacks", [{"_target_": "xtrainer.callbacks.EarlyStopping", "monitor": "val_loss",
                    "mode": {"_target_": "subprocess.call", "args": ["touch", "{marker}"]}}],
     "callbacks[0].mode._target_='subprocess.call' is refused"),
])
def test_functions_and_system_classes_are_refused_before_anything_is_built(
        write, tmp_path, capsys, no_trainer, key, spec, message):
    marker = tmp_path / "MARKER"
    spec = yaml.safe_load(yaml.safe_dump(spec).replace("{marker}", str(marker)).replace("{tmp}", str(tmp_path)))
    assert cli.main(["fit", "--config", write(**{key: spec})]) == 2
    err = one_line_error(capsys.readouterr().err)
    assert message in err, err
    assert not marker.exists() and tmp_path.exists()


def test_os_system_in_a_config_is_refused_by_the_real_command(write, tmp_path):
    marker = tmp_path / "MARKER"
    path = write(model={"_target_": "os.system", "command": f"touch {marker}"})
    done = subprocess.run([EXE, "fit", "--config", path], capture_output=True, text=True, cwd=TESTS,
                          env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert done.returncode == 2, done.stderr[-3000:]
    assert "model._target_='os.system' is refused: a _target_ names a class" in one_line_error(done.stderr)
    assert not marker.exists()


def test_a_standard_library_module_is_not_imported_for_a_config(monkeypatch):
    monkeypatch.chdir(TESTS)
    for name in ("antigravity", "this"):  # importing them opens a browser, prints a poem
        assert name not in sys.modules
        with pytest.raises(ConfigError, match=f"{name} is in Python's standard library, which holds none"):
            locate(f"{name}.Anything", "model", place("model"))
        assert name not in sys.modules


@pytest.mark.parametrize("dotted", [
    "os.system", "os.path.join", "posixpath.join", "subprocess.Popen", "builtins.type", "builtins.open",
    "shutil.rmtree", "importlib.import_module", "sys.exit", "pickle.loads", "marshal.loads", "ctypes.CDLL",
    "socket.socket", "pty.spawn", "runpy.run_path", "code.InteractiveConsole", "multiprocessing.Process",
    "signal.raise_signal", "io.FileIO", "_io.FileIO", "pathlib.Path", "tempfile.TemporaryDirectory",
    "logging.FileHandler", "xtrainer.config.targets.importlib.import_module", "conftest.torch.load", "conftest.os",
    "conftest.Regressor.__init__", "os", "", None, 3, "conftest..Regressor", "numpy.memmap", "numpy.ndarray",
    "torch.nn.Linear", "xtrainer.Trainer", "xtrainer.callbacks.EarlyStopping", "conftest.RegressionData",
])
def test_locate_gives_classes_of_the_place_only(dotted, monkeypatch):
    monkeypatch.chdir(TESTS)
    with pytest.raises(ConfigError, match=r"^model\._target_=.*(class|refused)"):
        locate(dotted, "model", place("model"))


def test_locate_accepts_classes_of_the_place(monkeypatch):
    monkeypatch.chdir(TESTS)
    from xtrainer.callbacks import EarlyStopping
    from xtrainer.loggers import TensorBoardLogger
    from xtrainer.strategies import XlaDDP

    assert locate("xtrainer.callbacks.EarlyStopping", "callbacks[0]", place("callbacks")) is EarlyStopping
    assert locate("xtrainer.loggers.TensorBoardLogger", "trainer.logger", place("logger")) is TensorBoardLogger
    assert locate("xtrainer.strategies.XlaDDP", "trainer.strategy", place("strategy")) is XlaDDP
    assert locate("conftest.Regressor", "model", place("model")) is Regressor
    assert locate("conftest.RegressionData", "data", place("data")) is RegressionData  # has *_dataloader()


# --------------------------------------------------------------------------------------------
# A nested _target_ fills a parameter: it must fit that parameter's annotation
# --------------------------------------------------------------------------------------------
def parts(**arguments) -> dict:
    return {"model": {"_target_": "test_config_safety.Parts", **arguments}}


def test_nested_targets_that_fit_their_annotation_are_built_in_place(write):
    path = write(**parts(head={"_target_": "torch.nn.Linear", "in_features": 8, "out_features": 2},
                         blocks=[{"_target_": "test_config_safety.Part", "width": 3}, {"_target_": "torch.nn.Tanh"}],
                         loss={"_target_": "torch.nn.L1Loss"}))
    checked = plan(load(["--config", path]), "fit")
    assert BUILT == []  # a plan builds nothing
    model = checked.model.build()
    assert isinstance(model.head, nn.Linear) and model.head.out_features == 2
    assert isinstance(model.blocks[0], Part) and model.blocks[0].width == 3 and isinstance(model.blocks[1], nn.Tanh)
    assert isinstance(model.loss, nn.L1Loss) and BUILT == ["part", "model"]


@pytest.mark.parametrize("arguments, message", [
    ({"head": {"_target_": "xtrainer.callbacks.EarlyStopping", "monitor": "x"}},
     "model.head._target_='xtrainer.callbacks.EarlyStopping' is refused: a _target_ names a class of the type its "
     "place expects, here a torch.nn.modules.module.Module (the annotation of the parameter it fills)"),
    ({"loss": {"_target_": "torch.nn.Linear", "in_features": 1, "out_features": 1}},
     "here a torch.nn.modules.loss.MSELoss or a torch.nn.modules.loss.L1Loss"),
    ({"blocks": [{"_target_": "torch.nn.Tanh"}, {"_target_": "numpy.memmap", "filename": "x", "mode": "w+"}]},
     "model.blocks[1]._target_='numpy.memmap' is refused"),
    ({"anything": {"_target_": "torch.nn.Tanh"}},
     "model.anything._target_='torch.nn.Tanh' is refused: the parameter 'anything' of test_config_safety.Parts has "
     "no class annotation (it has Any), so nothing says which classes it takes: annotate it"),
    ({"untyped": {"_target_": "torch.nn.Tanh"}}, "the parameter 'untyped' of test_config_safety.Parts has no class "
                                                 "annotation (it has none)"),
    ({"timeout": {"_target_": "datetime.timedelta", "hours": 1}}, "'timeout' of test_config_safety.Parts has no "
                                                                  "class annotation"),
    ({"lr": {"_target_": "torch.nn.Tanh"}}, "'lr' of test_config_safety.Parts has no class annotation (it has float)"),
    ({"surprise": {"_target_": "torch.nn.Tanh"}}, "'surprise' of test_config_safety.Parts has no class annotation"),
    ({"options": {"inner": {"_target_": "torch.nn.Tanh"}}},
     "model.options.inner._target_='torch.nn.Tanh' is refused: a _target_ fills a parameter whose annotation names "
     "a class, not a key inside the plain data model.options holds"),
    ({"head": {"_target_": "test_config_safety.Part", "width": "wide"}},
     "model.head.width='wide' is not a valid int (an argument of test_config_safety.Part)"),
    ({"head": {"_target_": "test_config_safety.Part", "depth": 2}}, "Unknown key 'model.head.depth'"),
])
def test_nested_targets_are_checked_against_the_parameter_they_fill(write, capsys, no_trainer, arguments, message):
    assert cli.main(["config", "--config", write(**parts(**arguments))]) == 2
    assert message in one_line_error(capsys.readouterr().err, "config")
    assert BUILT == []


def test_a_standard_library_class_fills_a_parameter_annotated_with_it(write, tmp_path):
    import datetime

    checked = plan(load(["--config", write(callbacks=[{
        "_target_": "xtrainer.callbacks.ModelCheckpoint",
        "train_time_interval": {"_target_": "datetime.timedelta", "minutes": 5}}])]), "fit")
    (callback,) = [t.build() for t in checked.callbacks]
    assert datetime.timedelta(minutes=5).total_seconds() in vars(callback).values()


def test_a_target_outside_every_place_is_refused(write, capsys):
    assert cli.main(["fit", "--config", write(trainer={"max_time": {"_target_": "torch.nn.Tanh"}})]) == 2
    assert "trainer.max_time._target_='torch.nn.Tanh' is refused: trainer.max_time takes a plain value" in \
        one_line_error(capsys.readouterr().err)


# --------------------------------------------------------------------------------------------
# What the README shows still works
# --------------------------------------------------------------------------------------------
README_FORMS = {
    "callbacks": [{"_target_": "xtrainer.callbacks.EarlyStopping", "monitor": "val_loss", "patience": 3},
                  {"_target_": "xtrainer.callbacks.ModelCheckpoint", "dirpath": "{tmp}/checkpoints",
                   "monitor": "val_loss"}],
    "trainer": {"logger": [{"_target_": "xtrainer.loggers.CSVLogger", "save_dir": "{tmp}/csv"},
                           {"_target_": "xtrainer.loggers.TensorBoardLogger", "save_dir": "{tmp}/tb"}],
                "strategy": {"name": "xla_fsdp", "reshard_after_forward": False, "auto_wrap_policy": 100000}},
}


def test_the_readme_forms_pass_xtrainer_config_which_writes_nothing(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    forms = yaml.safe_load(yaml.safe_dump(README_FORMS).replace("{tmp}", str(tmp_path)))
    configs = {
        "forms.yaml": {**BASE, **forms, "trainer": {**BASE["trainer"], **forms["trainer"],
                                                     "default_root_dir": str(tmp_path / "runs")}},
        "tensorboard.yaml": {**BASE, "trainer": {**BASE["trainer"], "logger": True, "strategy": "xla_ddp",
                                                 "default_root_dir": "runs"}},
        "classes.yaml": {**BASE, "trainer": {**BASE["trainer"], "logger": {"_target_": "xtrainer.loggers.CSVLogger"},
                                             "strategy": {"_target_": "xtrainer.strategies.XlaDDP"}}},
    }
    for name, config in configs.items():
        (tmp_path / name).write_text(yaml.safe_dump(config))
    before = snapshot(tmp_path)
    script = "; ".join(f"print(cli.main(['config', '--config', {str(tmp_path / name)!r}]), flush=True)"
                       for name in configs)
    done = subprocess.run([sys.executable, "-c", f"from xtrainer.launch import cli; {script}"], capture_output=True,
                          text=True, cwd=work, env={**os.environ, "PJRT_DEVICE": "CPU",
                                                    "PYTHONPATH": os.pathsep.join([ROOT, TESTS])})
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [line for line in done.stdout.splitlines() if line in ("0", "2")]
    assert printed == ["0", "0", "0"], done.stdout[-3000:]
    assert snapshot(tmp_path) == before  # no run folder, no checkpoint folder, no logger folder


def test_the_example_and_the_readme_forms_plan_and_build(write, tmp_path, monkeypatch):
    forms = yaml.safe_load(yaml.safe_dump(README_FORMS).replace("{tmp}", str(tmp_path)))
    checked = plan(load(["--config", write(**forms)]), "fit")
    assert [type(t.build()).__name__ for t in checked.callbacks] == ["EarlyStopping", "ModelCheckpoint"]
    assert [type(t.build()).__name__ for t in checked.logger] == ["CSVLogger", "TensorBoardLogger"]
    assert type(checked.strategy.build()).__name__ == "XlaFSDP"
    monkeypatch.chdir(ROOT)
    checked = plan(load(["--config", "examples/digits.yaml"]), "fit")
    assert checked.model.cls.__name__ == "DigitsClassifier" and checked.data.cls.__name__ == "DigitsData"
    assert checked.strategy == "xla_native"


def test_replaying_an_edited_saved_config_is_refused(write, tmp_path, capsys, no_trainer):
    saved = save_config(load(["--config", write()]), tmp_path / "runs" / "version_0")
    marker = tmp_path / "MARKER"
    edited = yaml.safe_load(open(saved))
    edited["model"] = {"_target_": "os.system", "command": f"touch {marker}"}
    with open(saved, "w") as f:
        yaml.safe_dump(edited, f)
    assert cli.main(["fit", "--config", saved]) == 2
    assert "model._target_='os.system' is refused" in one_line_error(capsys.readouterr().err)
    assert not marker.exists()


# --------------------------------------------------------------------------------------------
# Hostile YAML: one line, exit code 2
# --------------------------------------------------------------------------------------------
def laughs(levels: int = 9) -> str:
    text = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n'
    for prev, name in zip("abcdefghij", "bcdefghijk"[:levels - 1]):
        text += f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]\n"
    return text


@pytest.mark.parametrize("text, message", [
    # Where it is refused depends on the YAML library: libyaml 0.2.6 stops at its own limit.
    ("model: " + "[" * 3000 + "]" * 3000 + "\n", "line 1, column "),
    ("model: " + "[" * 3000 + "]" * 3000 + "\n", "nested more than 64 levels deep"),
    ("model: " + "[" * 70 + "]" * 70 + "\n", "line 1, column 71: nested more than 64 levels deep"),
    ("model:\n" + "".join("  " * (i + 1) + "a:\n" for i in range(3000)) + "  " * 3001 + "b: 1\n",
     "nested more than 64 levels deep"),
    ("model: {_target_: conftest.Regressor}\nseed: " + "9" * 5000 + "\n",
     "line 2, column 7: the integer 999999999999...999999 (5000 characters) does not fit in 64 bits"),
    ("model: {_target_: conftest.Regressor}\nseed: 1208925819614629174706176\n", "does not fit in 64 bits"),
    ("trainer:\n  x:\n" + textwrap.indent(laughs(), "    "), "its anchors and aliases expand to more than 100,000"),
    (laughs() + "model: {_target_: conftest.Regressor, lr: *i}\n", "expand to more than 100,000 values"),
    ("- model\n- data\n", "holds a list at its top level: a config file holds a mapping of keys"),
    ("hello\n", "holds a value at its top level: a config file holds a mapping of keys"),
    ("model: !!python/object:os.system {}\n", "line 1, column 8: the YAML tag '!!python/object:os.system' is not"),
    ("model:\n  _target_: !!python/name:os.system ''\n", "line 2, column 13: the YAML tag '!!python/name:os.system'"),
    ("model: !!python/object/apply:os.system ['touch {marker}']\n", "'!!python/object/apply:os.system' is not allowed"),
    ("model:\n  _target_: [conftest.Regressor,\n", "line 3, column 1: invalid YAML: did not find expected node"),
])
def test_hostile_yaml_is_one_line(write, tmp_path, capsys, no_trainer, text, message):
    marker = tmp_path / "MARKER"
    path = write(text.replace("{marker}", str(marker)))
    for command in ("fit", "config"):
        assert cli.main([command, "--config", path]) == 2
        err = one_line_error(capsys.readouterr().err, command)
        assert f"Config file {path!r}" in err and message in err, err
    assert not marker.exists()


@pytest.mark.parametrize("item, message", [
    ("model.lr=" + "[" * 3000 + "]" * 3000, "'model.lr=[[[[[[[[[[[[[[[["),
    ("seed=" + "9" * 5000, "does not fit in 64 bits"),
    ("model.lr={" + laughs().replace("\n", ", ").rstrip(", ") + "}", "expand to more than 100,000"),
    ("model.lr=!!python/name:os.system", "'model.lr=!!python/name:os.system': the YAML tag"),
])
def test_hostile_overrides_are_one_line(write, capsys, no_trainer, item, message):
    assert cli.main(["fit", "--config", write(), item]) == 2
    assert message in one_line_error(capsys.readouterr().err)


def test_a_deep_yaml_is_one_line_from_the_real_command(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("model: " + "[" * 3000 + "]" * 3000 + "\n")
    done = subprocess.run([EXE, "config", "--config", str(deep)], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert done.returncode == 2 and "nested more than 64 levels deep" in one_line_error(done.stderr, "config")


# --------------------------------------------------------------------------------------------
# Secrets reach the run, not its files
# --------------------------------------------------------------------------------------------
def test_names_that_look_secret():
    for name in ("token", "hf_token", "GITHUB_TOKEN", "apiToken", "secret", "client_secret", "AWS_SECRET_ACCESS_KEY",
                 "password", "DB_PASSWD", "api_key", "apiKey", "OPENAI_APIKEY", "credentials", "private_key",
                 "privateKey", "aws_access_key_id", "auth", "auth_header", "Authorization", "model.api_key",
                 "trainer/wandb-token"):
        assert looks_secret(name), name
    for name in ("tokenizer", "max_tokens", "num_tokens", "author", "authors", "lr", "tokenise", "monitor", None, 3):
        assert not looks_secret(name), name


def test_redact_walks_mappings_and_lists_and_keeps_numbers():
    environ = {"XT_DB_PASSWORD": "pa55-w0rd!", "XT_AUTH_MODE": "1", "HOME": "/home/me"}
    given = {"api_token": "sk-1", "max_tokens": 512, "token_id": 7, "tokenizer": "gpt2",
             "db": {"url": "postgres://me:pa55-w0rd!@db/x", "password": None}, "home": "/home/me",
             "wandb": [{"api_key": "k"}, "pa55-w0rd!"], "one": "1", "credentials": {"user": "me", "n": 3}}
    assert redact(given, environ) == {
        "api_token": REDACTED, "max_tokens": 512, "token_id": 7, "tokenizer": "gpt2",
        "db": {"url": f"postgres://me:{REDACTED}@db/x", "password": None}, "home": "/home/me",
        "wandb": [{"api_key": REDACTED}, REDACTED], "one": "1", "credentials": {"user": REDACTED, "n": 3}}


def test_secrets_reach_the_run_but_not_config_yaml_hparams_or_tensorboard(write, tmp_path, capsys, monkeypatch):
    token, password, key = "tok-1234567890-abcdef", "hunter2-but-longer", "wk-0987654321-zyx"
    monkeypatch.setenv("XT_TEST_TOKEN", token)
    monkeypatch.setenv("XT_DB_PASSWORD", password)
    monkeypatch.setenv("XT_WANDB_API_KEY", key)
    path = write(textwrap.dedent(f"""
        seed: 3
        model:
          _target_: test_config_safety.SecretModel
          api_token: ${{oc.env:XT_TEST_TOKEN}}
          endpoint: https://me:${{oc.env:XT_DB_PASSWORD}}@db.example/x
          label: ${{oc.env:XT_WANDB_API_KEY}}
          max_tokens: 512
          tokenizer: gpt2
        data: {{_target_: conftest.RegressionData}}
        trainer:
          max_epochs: 1
          enable_progress_bar: false
          enable_checkpointing: false
          default_root_dir: {tmp_path / 'runs'}
          logger:
            - {{_target_: xtrainer.loggers.TensorBoardLogger, name: ''}}
            - {{_target_: xtrainer.loggers.CSVLogger, name: ''}}
        """))
    assert cli.main(["fit", "--config", path]) == 0, capsys.readouterr().err
    assert SecretModel.given == {"api_token": token, "endpoint": f"https://me:{password}@db.example/x",
                                 "label": key}  # the run itself gets the real values
    written = {}
    for root, _, files in os.walk(tmp_path / "runs"):
        for name in files:
            written[os.path.relpath(os.path.join(root, name), tmp_path / "runs")] = open(os.path.join(root, name),
                                                                                         "rb").read()
    names = sorted(written)
    assert any(n.endswith("config.yaml") for n in names) and any(n.endswith("hparams.yaml") for n in names)
    assert any("tfevents" in n for n in names), names
    for name, content in written.items():
        for secret in (token, password, key):
            assert secret.encode() not in content, (name, secret)
    (config_yaml,) = [written[n] for n in names if n.endswith("config.yaml")]
    saved = yaml.safe_load(config_yaml)
    assert saved["model"]["api_token"] == REDACTED and saved["model"]["label"] == REDACTED
    assert saved["model"]["endpoint"] == f"https://me:{REDACTED}@db.example/x" and saved["model"]["max_tokens"] == 512
    for hparams in [written[n] for n in names if n.endswith("hparams.yaml")]:
        assert yaml.safe_load(hparams)["api_token"] == REDACTED and b"gpt2" in hparams
    events = b"".join(written[n] for n in names if "tfevents" in n)
    assert b"api_token" in events and REDACTED.encode() in events  # the HPARAMS view has the key, not the value
    # Running the saved file again asks for the secret instead of training with "***".
    saved_path = os.path.join(tmp_path / "runs", [n for n in names if n.endswith("config.yaml")][0])
    assert cli.main(["fit", "--config", saved_path]) == 2
    assert "model.api_token='***' is a secret the saved configuration does not hold: give it as model.api_token=" \
        in one_line_error(capsys.readouterr().err)


def test_xtrainer_config_prints_no_secret(write, capsys, monkeypatch):
    monkeypatch.setenv("XT_TEST_TOKEN", "tok-1234567890-abcdef")
    assert cli.main(["config", "--config", write(), "model._target_=test_config_safety.SecretModel",
                     "model.api_token=${oc.env:XT_TEST_TOKEN}"]) == 0
    out = capsys.readouterr().out
    assert "tok-1234567890" not in out and "api_token: '***'" in out


# --------------------------------------------------------------------------------------------
# Commands that read no configuration import nothing from the current folder
# --------------------------------------------------------------------------------------------
def test_consolidate_and_version_import_nothing_from_the_current_folder(tmp_path):
    for name in ("yaml", "torch", "omegaconf"):
        (tmp_path / f"{name}.py").write_text(f"open({str(tmp_path / ('RAN-' + name))!r}, 'w').close()\n"
                                             "raise SystemExit('imported from the current folder')\n")
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    done = subprocess.run([EXE, "consolidate", "no-such-checkpoint", "-o", "full.pt"], capture_output=True, text=True,
                          cwd=tmp_path, env=env)
    assert done.returncode == 1 and "xtrainer consolidate: error:" in done.stderr, done.stderr[-3000:]
    assert subprocess.run([EXE, "--version"], capture_output=True, text=True, cwd=tmp_path, env=env).returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("RAN-")) == []
    assert not (tmp_path / "full.pt").exists()


def test_a_config_command_imports_the_folders_own_module_but_never_in_place_of_an_installed_one(tmp_path):
    for name in ("yaml", "torch"):
        (tmp_path / f"{name}.py").write_text(f"open({str(tmp_path / ('RAN-' + name))!r}, 'w').close()\n")
    (tmp_path / "mymodels.py").write_text("from conftest import Regressor\n\nclass Mine(Regressor):\n    pass\n")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({**BASE, "model": {"_target_": "mymodels.Mine"}}))
    done = subprocess.run([EXE, "config", "--config", "run.yaml"], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": os.pathsep.join([ROOT, TESTS])})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "_target_: mymodels.Mine" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("RAN-")) == []
