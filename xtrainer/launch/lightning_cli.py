"""Lightning's ``LightningCLI``, for scripts that build their command line with it: the same
constructor, subcommands (``fit``, ``validate``, ``test``, ``predict``), ``--config`` files,
``--print_config``, ``--trainer.*``/``--model.*``/``--data.*`` options, ``--seed_everything``,
``--optimizer``/``--lr_scheduler``, the hooks a subclass overrides (``add_arguments_to_parser``,
``before_fit``...), and the ``config.yaml`` written into the run folder. Parsing is jsonargparse's,
as in Lightning; a configuration is data: ``class_path`` names only what its place's type admits
(a ``Callback`` subclass for a callback, an ``Optimizer`` subclass for ``--optimizer``...).

The ``xtrainer`` command (``launch/cli.py``) is the other way in: OmegaConf files with
``_target_`` and ``key=value`` overrides.
"""

from __future__ import annotations

import functools
import importlib
import random
import sys
from typing import Any, Callable, Iterable, Optional, Union

import torch
import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace, get_loader, set_loader, set_parsing_settings
from lightning_utilities.core.rank_zero import rank_zero_warn

from xtrainer.callbacks.base import Callback
from xtrainer.checkpoint import fs, read_hyperparameters
from xtrainer.config.loading import check_yaml
from xtrainer.config.schema import ConfigError
from xtrainer.config.redaction import redact
from xtrainer.datamodule import XDataModule
from xtrainer.loop.checkpoints import seed_everything
from xtrainer.module import XModule
from xtrainer.trainer import Trainer

# A configuration is data. jsonargparse's list of import paths a value may not name (os,
# subprocess, builtins' exec...) is enforced now rather than only warned about (its behaviour from
# jsonargparse 5 on); and a value of an argument that takes anything (untyped, or ``Any``) stays
# the dict it is, even with a ``class_path`` in it: only an argument typed with a class builds one
# of that class's subclasses. (jsonargparse's settings are its process-wide ones.)
set_parsing_settings(import_path_denylist=[], instantiate_subclass_spec_in_any=False)


def _checked_yaml(load: Callable[[str], Any]) -> Callable[[str], Any]:
    """jsonargparse's YAML loader, after the checks every configuration of xtrainer's passes
    (``check_yaml``): aliases of aliases that expand past ``MAX_NODES`` values, nesting deeper
    than ``MAX_DEPTH``, integers beyond 64 bits are refused at once, before anything expands them
    (a nine-level alias bomb kept jsonargparse busy for minutes)."""
    @functools.wraps(load)
    def checked(stream: str) -> Any:
        if isinstance(stream, str):
            try:
                check_yaml(stream, "its YAML")
            except ConfigError as err:  # a YAML error to jsonargparse: a parse error with its usage
                raise yaml.YAMLError(str(err)) from None
        return load(stream)

    checked.xtrainer_checked = True
    return checked


def _check_yaml_loaders() -> None:
    """The checks before each YAML loader of jsonargparse's: the default parser mode's, and
    OmegaConf's (``parser_mode="omegaconf"``, which Lightning's docs suggest), whose loader
    jsonargparse makes only when first used (``get_omegaconf_loader``, private: where it moved,
    that mode goes unchecked)."""
    if not getattr(get_loader("yaml"), "xtrainer_checked", False):
        set_loader("yaml", _checked_yaml(get_loader("yaml")), (yaml.YAMLError,))
    try:
        from jsonargparse._optionals import get_omegaconf_loader, omegaconf_support
    except ImportError:
        return
    for mode in ("omegaconf", "omegaconf+") if omegaconf_support else ():
        set_loader(mode, _checked_yaml(get_omegaconf_loader(mode)), (yaml.YAMLError,))


_check_yaml_loaders()


class ReduceLROnPlateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
    """torch's ``ReduceLROnPlateau`` with the metric it watches (``monitor``), so that
    ``--lr_scheduler ReduceLROnPlateau --lr_scheduler.monitor val_loss`` says everything."""

    def __init__(self, optimizer: torch.optim.Optimizer, monitor: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(optimizer, *args, **kwargs)
        self.monitor = monitor


#: What ``--lr_scheduler`` takes: any of torch's schedulers and ``ReduceLROnPlateau`` above.
LR_SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, ReduceLROnPlateau)
# Lightning's names for the types a module's arguments take (an optimizer or scheduler built
# later, from the configuration) and for what ``args`` takes.
LRSchedulerTypeTuple = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
LRSchedulerTypeUnion = Union[torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau]
OptimizerCallable = Callable[[Iterable], torch.optim.Optimizer]
LRSchedulerCallable = Callable[[torch.optim.Optimizer], LRSchedulerTypeUnion]
ArgsType = Optional[Union[list[str], dict[str, Any], Namespace]]


class LightningArgumentParser(ArgumentParser):
    """jsonargparse's parser, with Lightning's helpers for the classes a run is made of."""

    def __init__(self, *args: Any, description: str = "xtrainer command line tool", env_prefix: str = "PL",
                 default_env: bool = False, **kwargs: Any) -> None:
        # PL_: Lightning's prefix, so that PL_FIT__TRAINER__MAX_EPOCHS and PL_CONFIG mean the same here.
        super().__init__(*args, description=description, env_prefix=env_prefix, default_env=default_env, **kwargs)
        self.callback_keys: list[str] = []
        self._optimizers: dict[str, tuple[Any, str]] = {}
        self._lr_schedulers: dict[str, tuple[Any, str]] = {}

    def add_lightning_class_args(self, lightning_class: Any, nested_key: str, subclass_mode: bool = False,
                                 required: bool = True) -> list[str]:
        """The arguments of ``lightning_class`` (a Trainer, module, data module or callback) under
        ``nested_key``; a callback added so is added to the Trainer's callbacks."""
        if isinstance(lightning_class, type) and issubclass(lightning_class, Callback):
            self.callback_keys.append(nested_key)
        if subclass_mode:
            return self.add_subclass_arguments(lightning_class, nested_key, fail_untyped=False, required=required)
        return self.add_class_arguments(lightning_class, nested_key, fail_untyped=False, sub_configs=True,
                                        instantiate=not (isinstance(lightning_class, type)
                                                         and issubclass(lightning_class, Trainer)))

    def add_optimizer_args(self, optimizer_class: Any = (torch.optim.Optimizer,), nested_key: str = "optimizer",
                           link_to: str = "AUTOMATIC") -> None:
        """An optimizer's arguments under ``nested_key`` (any subclass where a tuple is given); with
        ``link_to="AUTOMATIC"`` it replaces the module's ``configure_optimizers`` when given."""
        self._optimizers[nested_key] = self._add_built_later(optimizer_class, nested_key, "params", link_to)

    def add_lr_scheduler_args(self, lr_scheduler_class: Any = LR_SCHEDULERS, nested_key: str = "lr_scheduler",
                              link_to: str = "AUTOMATIC") -> None:
        """A learning-rate scheduler's arguments under ``nested_key``, as ``add_optimizer_args``."""
        self._lr_schedulers[nested_key] = self._add_built_later(lr_scheduler_class, nested_key, "optimizer", link_to)

    def _add_built_later(self, cls: Any, nested_key: str, first: str, link_to: str) -> tuple[Any, str]:
        """The arguments of a class built later over ``first`` (parameters, an optimizer)."""
        kwargs: dict[str, Any] = {"instantiate": False, "fail_untyped": False, "skip": {first}}
        if isinstance(cls, tuple):
            self.add_subclass_arguments(cls, nested_key, **kwargs)
        else:
            self.add_class_arguments(cls, nested_key, sub_configs=True, **kwargs)
        return cls, link_to


def _with_specs_as_data(cls: type, *args: Any, **kwargs: Any) -> Any:
    """Builds ``cls`` as jsonargparse would, a class spec kept as data (an argument that takes
    anything) handed over as the nested dict it was written as: jsonargparse passes it spread
    over dotted names (``extra.class_path``, ``extra.init_args.mode``...)."""
    nested: dict[str, Any] = {}
    for key, value in kwargs.items():
        *parents, leaf = key.split(".")
        place = nested
        for parent in parents:
            place = place.setdefault(parent, {})
        place[leaf] = value
    return cls(*args, **nested)


class SaveConfigCallback(Callback):
    """Writes the run's configuration, as parsed, to ``config.yaml`` in the run folder when the
    stage starts (rank 0), and refuses to overwrite another run's there unless ``overwrite=True``
    (a run resumed from a checkpoint in that folder, or from ``"last"``, is that folder's run).
    ``save_config`` (rank 0) may also save it elsewhere. ``multifile`` is accepted for
    Lightning's signature: the configuration is written as one file."""

    def __init__(self, parser: LightningArgumentParser, config: Namespace, config_filename: str = "config.yaml",
                 overwrite: bool = False, multifile: bool = False, save_to_log_dir: bool = True) -> None:
        if not save_to_log_dir and type(self).save_config is SaveConfigCallback.save_config:
            raise ValueError("SaveConfigCallback(save_to_log_dir=False) saves nothing: subclass it and implement "
                             "save_config, or pass save_config_callback=None to LightningCLI.")
        self.parser, self.config = parser, config
        self.config_filename, self.overwrite, self.multifile = config_filename, overwrite, multifile
        self.save_to_log_dir = save_to_log_dir
        self.already_saved = False
        # Dumped now, secrets written as "***" (config/redaction.py): the parser stays in the
        # calling process, the replicas get the text.
        self.text = yaml.safe_dump(redact(yaml.safe_load(parser.dump(config, skip_unset=False))), sort_keys=False)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "parser": None}

    def setup(self, trainer: Trainer, module: XModule, stage: str) -> None:
        if self.already_saved:
            return
        if self.save_to_log_dir and trainer.is_global_zero:
            path = fs.join(trainer.log_dir, self.config_filename)
            if fs.exists(path) and not self.overwrite and not _resumes_in(self.config.get("ckpt_path"), trainer.log_dir):
                raise RuntimeError(
                    f"{type(self).__name__} found {path} already there: it belongs to a previous run. Delete it, pass "
                    "save_config_callback=None to LightningCLI not to save the configuration, or "
                    "save_config_kwargs={'overwrite': True} to replace it.")
            fs.makedirs(trainer.log_dir)
            fs.write_text(path, self.text)
        if trainer.is_global_zero:
            self.save_config(trainer, module, stage)
        self.already_saved = True

    def save_config(self, trainer: Trainer, module: XModule, stage: str) -> None:
        """Override to save the configuration somewhere else too (rank 0 only: no collectives here)."""


def _resumes_in(ckpt_path: Any, log_dir: str) -> bool:
    """Whether ``ckpt_path`` resumes the run of ``log_dir`` (``"last"``, or a checkpoint inside
    it): that run's folder, whose configuration the resumed one replaces."""
    if ckpt_path is None:
        return False
    if str(ckpt_path) == "last":
        return True
    return fs.inside(fs.normalize(str(ckpt_path)), fs.normalize(log_dir))


class LightningCLI:
    """Lightning's ``LightningCLI`` on xtrainer's Trainer: parses the command line (or ``args``)
    into a Trainer, a module and a data module, then runs the subcommand's Trainer method.

    Args:
        model_class: the module class; None: any ``XModule`` named with ``--model``.
        datamodule_class: the data module class; None: any ``XDataModule``, optional.
        save_config_callback: the callback that writes ``config.yaml``; None: none.
        save_config_kwargs: its arguments (``overwrite``, ``config_filename``...).
        trainer_class: the Trainer class.
        trainer_defaults: Trainer arguments' defaults; its ``callbacks`` are always added.
        seed_everything_default: the seed; True: a random one; False: no seeding.
        parser_kwargs: the parsers' arguments (per subcommand under its name).
        subclass_mode_model, subclass_mode_data: take any subclass, named with ``class_path``.
        args: the arguments to parse instead of ``sys.argv`` (a list, or a dict of the config).
        run: False: build the objects only (``cli.trainer.fit(cli.model)`` is yours to call).
        auto_configure_optimizers: add ``--optimizer`` and ``--lr_scheduler``.
        load_from_checkpoint_support: accepted for Lightning's signature: ``load_from_checkpoint``
            rebuilds a module from what ``save_hyperparameters`` saved, as always here.
    """

    def __init__(self, model_class: Any = None, datamodule_class: Any = None,
                 save_config_callback: type[SaveConfigCallback] | None = SaveConfigCallback,
                 save_config_kwargs: dict[str, Any] | None = None, trainer_class: Any = Trainer,
                 trainer_defaults: dict[str, Any] | None = None, seed_everything_default: bool | int = True,
                 parser_kwargs: dict[str, Any] | None = None,
                 parser_class: type[LightningArgumentParser] = LightningArgumentParser,
                 subclass_mode_model: bool = False, subclass_mode_data: bool = False,
                 args: ArgsType = None, run: bool = True, auto_configure_optimizers: bool = True,
                 load_from_checkpoint_support: bool = True) -> None:
        self.save_config_callback = save_config_callback
        self.save_config_kwargs = save_config_kwargs or {}
        self.trainer_class = trainer_class
        self.trainer_defaults = trainer_defaults or {}
        self.seed_everything_default = seed_everything_default
        self.parser_kwargs = parser_kwargs or {}
        self.parser_class = parser_class
        self.auto_configure_optimizers = auto_configure_optimizers
        del load_from_checkpoint_support
        self.model_class, self._model_class = model_class, model_class or XModule
        self.subclass_mode_model = model_class is None or subclass_mode_model
        self.datamodule_class, self._datamodule_class = datamodule_class, datamodule_class or XDataModule
        self.subclass_mode_data = datamodule_class is None or subclass_mode_data

        main_kwargs = {k: v for k, v in self.parser_kwargs.items() if k not in self.subcommands()}
        sub_kwargs = {k: v for k, v in self.parser_kwargs.items() if k in self.subcommands()}
        self.setup_parser(run, main_kwargs, sub_kwargs)
        self.parse_arguments(self.parser, args)
        self.subcommand = self.config["subcommand"] if run else None
        self._parse_ckpt_path()
        self._set_seed()
        self.before_instantiate_classes()
        self.instantiate_classes()
        self.after_instantiate_classes()
        if self.subcommand is not None:
            self._run_subcommand(self.subcommand)

    # ---- the parser ---------------------------------------------------------------------------
    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        parser = self.parser_class(**kwargs)
        parser.add_argument("-c", "--config", action=ActionConfigFile,
                            help="A configuration file (YAML or JSON); several are merged in order.")
        return parser

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict[str, Any], sub_kwargs: dict[str, Any]) -> None:
        self.parser = self.init_parser(**main_kwargs)
        self._subcommand_parsers: dict[str, LightningArgumentParser] = {}
        self._subcommand_method_arguments: dict[str, list[str]] = {}
        if not add_subcommands:
            self._add_arguments(self.parser)
            return
        subcommands = self.parser.add_subcommands()
        for name, skip in self.subcommands().items():
            method = getattr(self.trainer_class, name)
            description = (method.__doc__ or "").strip().split("\n")[0]
            kwargs = dict(sub_kwargs.get(name, {}))
            kwargs.setdefault("description", description)
            parser = self.init_parser(**kwargs)
            self._add_arguments(parser)
            self._subcommand_method_arguments[name] = parser.add_method_arguments(
                self.trainer_class, name, skip=set(skip))
            self._subcommand_parsers[name] = parser
            subcommands.add_subcommand(name, parser, help=description)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """Each subcommand and the arguments of its Trainer method that the CLI fills itself."""
        return {"fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
                "validate": {"model", "dataloaders", "datamodule"},
                "test": {"model", "dataloaders", "datamodule"},
                "predict": {"model", "dataloaders", "datamodule"}}

    def _add_arguments(self, parser: LightningArgumentParser) -> None:
        self.add_default_arguments_to_parser(parser)
        self.add_core_arguments_to_parser(parser)
        self.add_arguments_to_parser(parser)
        if self.auto_configure_optimizers:
            if not parser._optimizers:
                parser.add_optimizer_args((torch.optim.Optimizer,))
            if not parser._lr_schedulers:
                parser.add_lr_scheduler_args(LR_SCHEDULERS)
        for key, (_, link_to) in {**parser._optimizers, **parser._lr_schedulers}.items():
            if link_to != "AUTOMATIC":
                parser.link_arguments(key, link_to)

    def add_default_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--seed_everything", type=Union[bool, int], default=self.seed_everything_default,
                            help="The seed set before the classes are built; true: a random one; false: none.")

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        parser.set_defaults({f"trainer.{k}": v for k, v in self.trainer_defaults.items() if k != "callbacks"})
        parser.add_lightning_class_args(self._model_class, "model", subclass_mode=self.subclass_mode_model)
        parser.add_lightning_class_args(self._datamodule_class, "data", subclass_mode=self.subclass_mode_data,
                                        required=self.datamodule_class is not None)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Override to add arguments or links (``parser.link_arguments``)."""

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        if args is not None and len(sys.argv) > 1:
            rank_zero_warn(f"LightningCLI got both args={args!r} and command-line arguments {sys.argv[1:]!r}: "
                           "args is parsed, the command line is not.")
        if isinstance(args, (dict, Namespace)):
            self.config = parser.parse_object(args)
        else:
            self.config = parser.parse_args(args)

    def adapt_checkpoint_hparams(self, subcommand: str, checkpoint_hparams: dict[str, Any]) -> dict[str, Any]:
        """Override to change the hyperparameters a ``--ckpt_path`` checkpoint gives the module
        (drop the training-only ones for ``predict``, say); return them."""
        return checkpoint_hparams

    def _parse_ckpt_path(self) -> None:
        """As Lightning's: a subcommand's ``--ckpt_path`` file gives the module its arguments, the
        hyperparameters it was saved with (``save_hyperparameters``), over the command line's."""
        if self.subcommand is None:
            return
        ckpt_path = self.config[self.subcommand].get("ckpt_path")
        if not ckpt_path or str(ckpt_path) in ("last", "best") or not fs.exists(str(ckpt_path)):
            return  # the Trainer resolves those names, and says what is missing
        hparams = self.adapt_checkpoint_hparams(self.subcommand, read_hyperparameters(str(ckpt_path)))
        if not hparams:
            return
        model: Any = hparams
        if self.subclass_mode_model:  # the arguments of the class the command line names
            class_path = (self.config[self.subcommand].get("model") or {}).get("class_path")
            if class_path is None:
                return
            model = {"class_path": class_path, "init_args": hparams}
        self.config = self.parser.parse_object({self.subcommand: {"model": model}}, self.config)

    # ---- building -----------------------------------------------------------------------------
    def before_instantiate_classes(self) -> None:
        """Override to run code before the classes are built."""

    def after_instantiate_classes(self) -> None:
        """Override to run code after the classes are built."""

    def instantiate_classes(self) -> None:
        self.config_init = self._parser(self.subcommand).instantiate(
            self._config(self.config), instantiators=[(_with_specs_as_data, object, True)])
        self.datamodule = self.config_init.get("data")
        self.model = self.config_init.get("model")
        self._add_configure_optimizers_method_to_model()
        self.trainer = self.instantiate_trainer()

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer = self.config_init.get("trainer")
        # Top-level arguments, a value that stayed a class spec as a plain dict (Namespace's own
        # ** would spread its nested keys, "plugins.class_path").
        config = {**(trainer.as_dict() if isinstance(trainer, Namespace) else dict(trainer or {})), **kwargs}
        callbacks = config.get("callbacks")
        callbacks = [] if callbacks is None else list(callbacks) if isinstance(callbacks, (list, tuple)) \
            else [callbacks]
        callbacks += [self.config_init[key] for key in self._parser(self.subcommand).callback_keys]
        defaults = self.trainer_defaults.get("callbacks", [])
        callbacks += defaults if isinstance(defaults, list) else [defaults]
        if self.save_config_callback is not None and not config.get("fast_dev_run", False):
            callbacks.append(self.save_config_callback(self._parser(self.subcommand), self._config(self.config),
                                                       **self.save_config_kwargs))
        config["callbacks"] = callbacks
        return self.trainer_class(**config)

    @staticmethod
    def configure_optimizers(lightning_module: XModule, optimizer: torch.optim.Optimizer,
                             lr_scheduler: Any = None) -> Any:
        """What the module's ``configure_optimizers`` returns where ``--optimizer`` was given."""
        if lr_scheduler is None:
            return optimizer
        if isinstance(lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            return {"optimizer": optimizer,
                    "lr_scheduler": {"scheduler": lr_scheduler, "monitor": getattr(lr_scheduler, "monitor", None)}}
        return [optimizer], [lr_scheduler]

    def _add_configure_optimizers_method_to_model(self) -> None:
        if not self.auto_configure_optimizers or self.model is None:
            return
        parser = self._parser(self.subcommand)
        automatic = [key for key, (_, link) in parser._optimizers.items() if link == "AUTOMATIC"]
        schedulers = [key for key, (_, link) in parser._lr_schedulers.items() if link == "AUTOMATIC"]
        if len(automatic) > 1 or len(schedulers) > 1:
            raise ValueError(f"{type(self).__name__}: at most one optimizer and one lr_scheduler can be AUTOMATIC, got "
                             f"{automatic + schedulers}; link the others and write configure_optimizers yourself.")
        optimizer = _class_config(self.config_init.get(automatic[0]), parser._optimizers[automatic[0]][0]) \
            if automatic else None
        if optimizer is None:
            return  # no --optimizer given: the module's own configure_optimizers
        scheduler = _class_config(self.config_init.get(schedulers[0]), parser._lr_schedulers[schedulers[0]][0]) \
            if schedulers else None
        if type(self.model).configure_optimizers is not XModule.configure_optimizers:
            rank_zero_warn(f"{type(self.model).__name__}.configure_optimizers is replaced by the --optimizer given "
                           f"({type(self).__name__}.configure_optimizers).")
        self.model.configure_optimizers = _ConfiguredOptimizers(
            self.model, optimizer, scheduler, type(self).configure_optimizers)

    # ---- running ------------------------------------------------------------------------------
    def _run_subcommand(self, subcommand: str) -> None:
        before = getattr(self, f"before_{subcommand}", None)
        if callable(before):
            before()
        method = getattr(self, subcommand, getattr(self.trainer, subcommand))
        method(**self._prepare_subcommand_kwargs(subcommand))
        after = getattr(self, f"after_{subcommand}", None)
        if callable(after):
            after()

    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict[str, Any]:
        kwargs = {k: v for k, v in self.config_init.items() if k in self._subcommand_method_arguments[subcommand]}
        kwargs["model"] = self.model
        if self.datamodule is not None:
            kwargs["datamodule"] = self.datamodule
        return kwargs

    def _set_seed(self) -> None:
        config = self._config(self.config)
        seed = config.get("seed_everything")
        if seed is False or seed is None:
            return
        if seed is True:
            seed = random.SystemRandom().randrange(2**31)  # a random seed, recorded in the saved config
        config["seed_everything"] = seed_everything(int(seed), workers=True)

    def _parser(self, subcommand: str | None) -> LightningArgumentParser:
        return self.parser if subcommand is None else self._subcommand_parsers[subcommand]

    def _config(self, config: Namespace) -> Namespace:
        """The subcommand's part of a parsed configuration (all of it without subcommands)."""
        return config[self.subcommand] if self.subcommand is not None else config


class _ConfiguredOptimizers:
    """The module's ``configure_optimizers`` where ``--optimizer`` was given: the optimizer (and
    scheduler) built when the Trainer asks, over the parameters as the strategy placed them."""

    def __init__(self, module: XModule, optimizer: dict[str, Any], scheduler: dict[str, Any] | None,
                 combine: Callable[..., Any]) -> None:
        self.module, self.optimizer, self.scheduler, self.combine = module, optimizer, scheduler, combine

    def __call__(self) -> Any:
        optimizer = instantiate_class(self.module.parameters(), self.optimizer)
        scheduler = instantiate_class(optimizer, self.scheduler) if self.scheduler is not None else None
        return self.combine(self.module, optimizer, scheduler)


def _class_config(value: Any, base: Any) -> dict[str, Any] | None:
    """``{"class_path", "init_args"}`` of a parsed optimizer or scheduler group (None: not given)."""
    if value is None:
        return None
    value = value.as_dict() if isinstance(value, Namespace) else dict(value)
    if "class_path" in value:
        return {"class_path": value["class_path"], "init_args": dict(value.get("init_args") or {})}
    if isinstance(base, type):  # a group of one class's arguments
        if not value:
            return None
        return {"class_path": f"{base.__module__}.{base.__qualname__}", "init_args": value}
    return None


def instantiate_class(args: Any, init: dict[str, Any]) -> Any:
    """Lightning's helper: the class ``init["class_path"]`` names, built with ``args`` (one or a
    tuple) and ``init["init_args"]`` (a ``class_path`` that the configuration's type checked)."""
    module, _, name = init["class_path"].rpartition(".")
    args = args if isinstance(args, tuple) else (args,)
    return getattr(importlib.import_module(module), name)(*args, **(init.get("init_args") or {}))
