"""Configuration: a typed schema filled from YAML files and ``key=value`` overrides (OmegaConf).

A run is described by ``RunConfig``::

    seed: 0
    model:    {_target_: mypkg.models.Classifier, hidden: 256}     # the XModule and its arguments
    data:     {_target_: mypkg.data.Digits, batch_size: 64}        # optional: *_dataloader() methods
    strategy: xla_fsdp                 # or {name: xla_fsdp, reshard_after_forward: false}
    callbacks: [{_target_: xtrainer.callbacks.EarlyStopping, monitor: val_loss}]
    trainer:  {max_epochs: 8, devices: 4}                          # every other Trainer argument
    ckpt_path: null                    # or "last", or a checkpoint's path

Sources merge in order: the schema's defaults, each ``--config`` file, then ``key=value`` items.
Interpolations (``${model.hidden}``) and environment variables (``${oc.env:DATA_DIR}``) resolve
as in OmegaConf. ``load`` returns plain dataclasses and ``build`` turns them into a ``Trainer``,
a module and data, so nothing below the entry point sees an OmegaConf object. Every mistake
raises ``ConfigError`` with a message naming the key (and, for an unknown key, the closest valid
one) before anything trains.

``_target_`` is resolved by a small resolver over ``importlib`` (not Hydra, not jsonargparse): a
configuration is checked whole before anything in it is built (``plan``), and only then built
(``build``). Every ``_target_`` names a class, never a function, a method or a builtin, and the
class must be of the type its place expects: ``model`` an ``XModule`` subclass, ``data`` an
``XDataModule`` subclass or a class with ``*_dataloader()`` methods, ``trainer.callbacks`` a
``Callback``, ``trainer.logger`` a ``Logger``, ``trainer.strategy`` a ``Strategy`` (or a
strategy's name); a ``_target_`` inside arguments must fit the annotation of the parameter it
fills (a class, ``Optional`` or a union of classes, or a list of them), and a parameter without
one (none, ``Any``, ``object``, a builtin type) takes none. A ``_target_`` anywhere else is
refused. The arguments are checked against the class's signature too. So a configuration (or a
run's saved ``config.yaml`` edited by someone else) cannot call ``os.system``, ``subprocess.Popen``
or ``numpy.memmap``: they are not of the type of any place.

What remains, and is trusted: importing a module named in a configuration runs that module's
top-level code. Names are checked for their form first, modules are imported only as far as a
name needs, and no standard-library module is imported on a configuration's behalf (some run
code when imported); a module of your own (from the current folder or an installed package) is
your code. A class of the right type runs its own constructor with the configuration's
arguments: a logger or ``ModelCheckpoint`` writes where its ``save_dir``/``dirpath`` says, so
read the paths of a configuration you did not write. ``xtrainer config`` builds none of your
classes, only xtrainer's own (which create no file or folder until a run starts).

Hostile YAML is refused in one line before it is built: nesting deeper than ``MAX_DEPTH``,
anchors and aliases that expand to more than ``MAX_NODES`` values, integers beyond 64 bits, a
top level that is not a mapping. Secrets (``${oc.env:WANDB_API_KEY}``, a key named ``api_token``)
reach the run but are written as ``"***"`` in ``config.yaml`` (``xtrainer/config/redaction.py``).

The package, by concern: ``schema.py`` (``RunConfig``, ``TrainerConfig``, ``ConfigError``),
``settings.py`` (the Trainer's settings: one dataclass, also the schema's ``trainer``),
``arguments.py`` (what the Trainer makes of its arguments: default callbacks, devices, Lightning's
modes), ``loading.py`` (files and overrides merged and checked; ``config.yaml`` written back),
``targets.py`` (each ``_target_`` checked against the type of its place), ``building.py`` (a run
checked whole, then built) and ``redaction.py`` (secrets hidden from what a run writes).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: Each public name and the module that defines it, imported on first use: the Trainer imports
#: ``config.settings`` and ``config.arguments`` without loading OmegaConf and YAML.
_LAZY = {
    **dict.fromkeys(("Plan", "Run", "build", "check", "check_run", "plan"), "xtrainer.config.building"),
    **dict.fromkeys(("flatten", "load", "load_config", "save_config", "split_argv", "to_yaml"),
                    "xtrainer.config.loading"),
    **dict.fromkeys(("CONFIG_FILE", "TARGET", "ConfigError", "RunConfig", "TrainerConfig", "trainer_kwargs"),
                    "xtrainer.config.schema"),
    "instantiate": "xtrainer.config.targets",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:  # for type checkers, IDEs and the API reference: the names as if imported eagerly
    from xtrainer.config.building import Plan, Run, build, check, check_run, plan
    from xtrainer.config.loading import flatten, load, load_config, save_config, split_argv, to_yaml
    from xtrainer.config.schema import CONFIG_FILE, TARGET, ConfigError, RunConfig, TrainerConfig, trainer_kwargs
    from xtrainer.config.targets import instantiate


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'xtrainer.config' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
