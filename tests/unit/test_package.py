"""The package's public paths, whatever folder a concern lives in: every ``_target_`` the docs,
examples and README name resolves to the class of its place, the names users import from
``xtrainer.loggers``, ``xtrainer.config`` and ``xtrainer.cli`` are there, and ``python -m xtrainer``
runs the command. Nothing is trained."""

import os
import re
import subprocess
import sys

import conftest
import pytest
from conftest import subprocess_timeout

import xtrainer
from xtrainer.config.targets import locate, place

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(conftest.__file__)))
#: ``_target_: xtrainer.x.Y`` (YAML) or ``"_target_": "xtrainer.x.Y"`` (Python) in a documented file.
_TARGET = re.compile(r"""_target_["']?\s*:\s*["']?(xtrainer\.[A-Za-z_][A-Za-z0-9_.]*)""")
_PLACES = {"callbacks": "callbacks", "loggers": "logger", "strategies": "strategy"}


def _documented_targets() -> set[str]:
    paths = [os.path.join(ROOT, "README.md")]
    for folder in ("docs", "examples"):
        for here, _, files in os.walk(os.path.join(ROOT, folder)):
            paths += [os.path.join(here, f) for f in files if f.endswith((".md", ".yaml", ".yml", ".py"))]
    return {m.group(1) for path in paths for m in _TARGET.finditer(open(path, encoding="utf-8").read())}


def test_the_finder_sees_documented_targets():
    assert {"xtrainer.callbacks.EarlyStopping", "xtrainer.loggers.CSVLogger"} <= _documented_targets()


@pytest.mark.parametrize("dotted", sorted(_documented_targets()))
def test_every_documented_target_names_a_class_of_its_place(dotted):
    package = dotted.split(".")[1]
    assert package in _PLACES, f"{dotted}: which place takes it? add its package to _PLACES"
    cls = locate(dotted, "documented", place(_PLACES[package]))
    assert cls.__name__ == dotted.rsplit(".", 1)[1]


def test_the_names_users_import_stay_where_they_import_them():
    from xtrainer import cli, config, loggers
    from xtrainer.launch import cli as command

    for name in ("CSVLogger", "Logger", "TensorBoardLogger", "claim_run_folder", "claim_version_dir",
                 "move_run_folder", "run_folder_root"):
        assert name in loggers.__all__ and getattr(loggers, name).__module__.startswith("xtrainer.loggers.")
    assert issubclass(loggers.CSVLogger, loggers.Logger) and issubclass(loggers.TensorBoardLogger, loggers.Logger)
    for name in ("RunConfig", "TrainerConfig", "ConfigError", "load", "load_config", "build", "check_run",
                 "save_config", "trainer_kwargs", "to_yaml", "instantiate"):
        assert name in config.__all__ and getattr(config, name).__module__.startswith("xtrainer.config.")
    assert (cli.main, cli.run_stage) == (command.main, command.run_stage)
    assert xtrainer.TrainingInterrupted.__module__ == "xtrainer.launch.interrupts"


@pytest.mark.parametrize("module", ["xtrainer", "xtrainer.cli"])
def test_python_dash_m_runs_the_command(module):
    done = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=subprocess_timeout(120))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"xtrainer {xtrainer.__version__}")


def _contributing_rows() -> list[list[str]]:
    """The paths each row of ``docs/contributing.md``'s table of owners names in its first column
    (relative to ``xtrainer/``; a folder ends with ``/``)."""
    text = open(os.path.join(ROOT, "docs", "contributing.md"), encoding="utf-8").read()
    table = text[text.index("Where each concern lives"):]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    return [re.findall(r"`([^`]+)`", row.split(" | ")[0]) for row in rows]


def _only_reexports(path: str) -> bool:
    """Whether a package's ``__init__.py`` defines nothing but its lazy names (``__getattr__``,
    ``__dir__``): its package's rows then speak for it."""
    import ast

    defined = [node.name for node in ast.parse(open(path, encoding="utf-8").read()).body
               if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    return set(defined) <= {"__getattr__", "__dir__"}


def test_every_module_has_a_row_in_the_contributing_guide():
    """``docs/contributing.md`` says where each concern lives: every module under ``xtrainer/`` is
    named by a row (a folder row covers its package; an ``__init__.py`` that only re-exports is
    covered by any row of its package), and every path a row names exists."""
    package = os.path.join(ROOT, "xtrainer")
    modules = sorted(os.path.relpath(os.path.join(folder, f), package).replace(os.sep, "/")
                     for folder, _, files in os.walk(package) for f in files if f.endswith(".py"))
    assert "strategies/native_fsdp.py" in modules and "checkpoint/fs.py" in modules
    named = [path for row in _contributing_rows() for path in row]
    missing_paths = [path for path in named if not os.path.exists(os.path.join(package, path))]
    assert not missing_paths, f"docs/contributing.md names what is not there: {missing_paths}"
    files, folders = {p for p in named if p.endswith(".py")}, [p for p in named if p.endswith("/")]

    def covered(module: str) -> bool:
        if module in files or any(module.startswith(folder) for folder in folders):
            return True
        parent = module.rpartition("/")[0]
        return (module.endswith("__init__.py") and parent != "" and _only_reexports(os.path.join(package, module))
                and any(path.startswith(parent + "/") for path in named))

    unnamed = [module for module in modules if not covered(module)]
    assert not unnamed, f"add a row to docs/contributing.md's table for: {unnamed}"
