"""The ``xtrainer`` command.

    xtrainer fit --config run.yaml [key=value ...]       # also validate, test, predict
    xtrainer config --config run.yaml [key=value ...]    # check, then print the resolved configuration
    xtrainer consolidate CHECKPOINT_DIR -o full.pt       # one state dict from a sharded folder
    xtrainer doctor                                      # check this machine (xtrainer/launch/doctor.py)
    xtrainer --version

A configuration mistake is a one-line message and exit code 2, before anything trains. A fit
writes the resolved configuration to ``<run folder>/config.yaml``; ``xtrainer fit --config`` on
that file runs the same configuration again.

This module imports nothing heavy at the top: ``xtrainer --help`` and ``--version`` answer without
importing torch or torch_xla (several seconds); each command imports what it needs.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from xtrainer.config import RunConfig

_STAGES = ("fit", "validate", "test", "predict")
_COMMANDS = (*_STAGES, "config")
_EXAMPLE = "examples: --config run.yaml   --config base.yaml --config small.yaml trainer.max_epochs=3 model.lr=1e-3"
#: The data each stage runs on: ``<name>_dataloader()`` of ``data`` (or of the model).
_LOADER = {"fit": "train", "validate": "val", "test": "test", "predict": "predict"}
#: The step method each evaluation stage needs (``predict_step`` has a default).
_STEP = {"validate": "validation_step", "test": "test_step"}


def run_stage(stage: str, config: "RunConfig") -> tuple[Any, Any]:
    """Build the run ``config`` describes and run ``stage``; returns (trainer, what it returned).
    What the configuration lacks for ``stage`` (its data, its step method, the checkpoint
    ``ckpt_path`` names) is refused before the run folder is claimed; a run that fails before it
    wrote anything but its ``config.yaml`` leaves no folder behind."""
    from xtrainer import config as cfg_io

    run = cfg_io.build(config, stage)
    trainer, model = run.trainer, run.model
    _check_step(stage, model)
    names = ("train", "val") if stage == "fit" else (_LOADER[stage],)
    if stage == "fit" and not _has_step(model, "validation_step"):
        names = ("train",)  # as Lightning does: no validation_step, no validation loop
    loaders = {name: _dataloader(run.data, name) for name in names}
    _check_data(stage, run, loaders[_LOADER[stage]])
    if stage == "fit":
        _check_train_batches(config, loaders["train"])
    # The saved configuration names the checkpoint actually used (not "last"), so running it
    # again starts from the same state.
    config.ckpt_path = _resolve_checkpoint(trainer, stage, run.ckpt_path)
    path = None
    if claims_run_folder():  # one run folder, one config.yaml (torchrun's other ranks learn rank 0's)
        path = cfg_io.save_config(config, trainer.log_dir)
        print(f"xtrainer {stage}: run folder {trainer.log_dir} (configuration: {path})", flush=True)
    try:
        if stage == "fit":
            return trainer, trainer.fit(model, loaders["train"], loaders.get("val"), ckpt_path=run.ckpt_path)
        method = {"validate": trainer.validate, "test": trainer.test, "predict": trainer.predict}[stage]
        return trainer, method(model, loaders[_LOADER[stage]], ckpt_path=run.ckpt_path)
    except BaseException:
        if path is not None:
            _remove_unused_run_folder(trainer.log_dir, path)
        raise


def claims_run_folder() -> bool:
    from xtrainer.loop.stages import claims_run_folder

    return claims_run_folder()


def _has_step(model: Any, step: str) -> bool:
    from xtrainer.module import XModule

    return getattr(type(model), step, None) is not getattr(XModule, step)


def _check_step(stage: str, model: Any) -> None:
    step = _STEP.get(stage)
    if step is not None and not _has_step(model, step):
        cls = type(model)
        raise _config_error(f"model: {cls.__module__}.{cls.__qualname__} has no {step}(self, batch, batch_idx) to "
                            f"{stage} with: add one, or set model._target_ to a class that has one.")


def _check_data(stage: str, run: Any, loader: Any) -> None:
    """Refuse a stage with nothing to run on: no ``<name>_dataloader()`` in ``data`` nor in the model."""
    hook = f"{_LOADER[stage]}_dataloader"
    if loader is not None or callable(getattr(run.model, hook, None)):
        return
    model = f"{type(run.model).__module__}.{type(run.model).__qualname__}"
    if run.data is None:
        where = f"the configuration has no data, and the model ({model}) has no {hook}()"
    else:
        data = f"{type(run.data).__module__}.{type(run.data).__qualname__}"
        has = callable(getattr(run.data, hook, None))
        where = (f"data ({data}).{hook}() returned None" if has else f"data ({data}) has no {hook}()") + \
            f", and the model ({model}) has none either"
    raise _config_error(f"nothing to {stage} on: {where}. Set data._target_ to a class with a {hook}() method "
                        f"(its arguments as data.<name>=...).")


def _resolve_checkpoint(trainer: Any, stage: str, ckpt_path: Any) -> Any:
    """``trainer.resolve_ckpt_path``; for validate/test/predict, ``ckpt_path=last`` that finds no
    checkpoint is an error (evaluating untrained weights is never what was asked), not the
    warning a fit gives before it starts from scratch."""
    if stage == "fit" or ckpt_path is None:
        return trainer.resolve_ckpt_path(ckpt_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolved = trainer.resolve_ckpt_path(ckpt_path)
    found_none = [w for w in caught if "found no checkpoint" in str(w.message)]
    if resolved is None:
        from xtrainer.checkpoint import CheckpointNotFoundError

        where = str(found_none[0].message).split(" in ", 1)[-1].split(": ", 1)[0] if found_none else None
        raise CheckpointNotFoundError(
            f"ckpt_path={ckpt_path!r}: no checkpoint" + (f" in {where}" if where else "") + f" to {stage}. "
            "Run xtrainer fit with this configuration first, or set ckpt_path=<a checkpoint's path> "
            "(ckpt_path=null uses the model as its constructor builds it).")
    for w in caught:  # anything else (a checkpoint skipped on the way) still shows
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return resolved


def _remove_unused_run_folder(folder: str, config_file: str) -> None:
    """Remove ``folder`` if the run wrote nothing into it but its ``config.yaml``."""
    try:
        if os.listdir(folder) == [os.path.basename(config_file)]:
            os.remove(config_file)
            os.rmdir(folder)
    except OSError:
        pass


def _dataloader(data: Any, name: str) -> Any:
    """``data.<name>_dataloader()`` (None without one); a ``ValueError`` or ``TypeError`` from it, such
    as a DataLoader refusing ``batch_size=0``, is a mistake in ``data``'s arguments."""
    method = getattr(data, f"{name}_dataloader", None)
    if method is None:
        return None
    try:
        return method()
    except (TypeError, ValueError) as err:
        raise _config_error(f"data: {type(data).__name__}.{name}_dataloader() failed: "
                            f"{' '.join(str(err).split())}") from None


def _check_train_batches(config: "RunConfig", loader: Any) -> None:
    """Refuse a ``trainer.limit_train_batches`` fraction that leaves none of the loader's batches."""
    limit = getattr(config.trainer, "limit_train_batches", 1.0)
    try:
        length = len(loader)
    except TypeError:
        return
    if isinstance(limit, float) and 0.0 < limit < 1.0 and length > 0 and int(length * limit) == 0:
        raise _config_error(f"trainer.limit_train_batches={limit} leaves none of the {length} training batches: "
                            "give a larger fraction or a number of batches.")


def _config_error(message: str) -> Exception:
    from xtrainer.config import ConfigError

    return ConfigError(message)


def _stage_command(args: argparse.Namespace) -> int:
    from xtrainer import config as cfg_io

    config = cfg_io.load(args.items)
    trainer, result = run_stage(args.command, config)
    if not claims_run_folder():
        return 0  # rank 0 of the processes torchrun started prints the run's values, and writes its predictions
    if args.command == "fit":
        for name, value in sorted(trainer.callback_metrics.items()):
            print(f"  {name}: {value:.6g}")
    elif args.command == "predict":
        path = os.path.join(trainer.log_dir, "predictions.pt")
        import torch

        torch.save(result, path)  # the user's predict_step outputs, as they are
        print(f"  predictions: {path}")
    else:
        for i, metrics in enumerate(result):
            print(f"  dataloader {i}: " + ", ".join(f"{k}={v:.6g}" for k, v in sorted(metrics.items())))
    return 0


def _config_command(args: argparse.Namespace) -> int:
    """Check the configuration as ``fit`` would (everything but constructing the model and the
    data), then print it."""
    from xtrainer import config as cfg_io

    config = cfg_io.load(args.items)
    cfg_io.check_run(config, "fit")
    print(cfg_io.to_yaml(config), end="")
    return 0


def _consolidate_command(args: argparse.Namespace) -> int:
    from xtrainer import checkpoint as ckpt_io

    if ckpt_io.fs.within(args.output, args.checkpoint):
        raise ckpt_io.CheckpointError(f"-o {args.output} would overwrite the checkpoint it reads ({args.checkpoint}); "
                                      "write the consolidated weights somewhere else.")
    state_dict = ckpt_io.consolidate(args.checkpoint)
    ckpt_io.storage.write_file(state_dict, args.output, advice="Nothing was written; the checkpoint is intact.")
    total = sum(t.numel() for t in state_dict.values())
    print(f"wrote {args.output}: {len(state_dict)} tensors, {total:,} values. "
          "Load it with module.load_state_dict(torch.load(path)).")
    return 0


class _VersionAction(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> NoReturn:
        from xtrainer.launch.doctor import version  # light: reads package metadata only

        print(version())
        parser.exit()


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (and exit code 2) like every other mistake."""

    def error(self, message: str) -> NoReturn:
        from xtrainer.suggest import did_you_mean

        hint = ""
        if "invalid choice:" in message:  # a command given wrong
            given = message.split("invalid choice:", 1)[1].split("(", 1)[0].strip().strip("'")
            hint = did_you_mean(given, (*_COMMANDS, "consolidate"))
        what = "the commands" if self.prog == "xtrainer" else "its arguments"
        self.exit(2, f"{self.prog}: error: {message}.{hint} Run {self.prog} --help for {what}.\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="xtrainer", description="Train PyTorch models on XLA devices.")
    parser.add_argument("--version", action=_VersionAction,
                        help="print the versions of xtrainer, torch, torch_xla and Python, and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for stage in _COMMANDS:
        verb = {"config": "", "predict": "predict with"}.get(stage, stage)
        what = f"{verb} the model a configuration describes" if verb else \
            "check the configuration as fit does, then print it resolved (defaults included)"
        sub = commands.add_parser(stage, help=what, description=what + ". " + _EXAMPLE)
        sub.add_argument("items", nargs="*", metavar="key=value",
                         help="--config FILE.yaml (repeatable, merged in order), then key=value overrides")
        sub.set_defaults(run=_config_command if stage == "config" else _stage_command)
    consolidate = commands.add_parser(
        "consolidate", help="stitch a sharded checkpoint folder (xla_fsdp, xla_spmd, xla_fsdpv2) into one plain "
                            "state dict")
    consolidate.add_argument("checkpoint", help="the checkpoint folder (holds trainer.pt, and rank-*-of-*.pt or state/)")
    consolidate.add_argument("-o", "--output", required=True, help="where to write the state dict (.pt)")
    consolidate.set_defaults(run=_consolidate_command)
    from xtrainer.launch import doctor  # light: imports torch only when it runs

    doctor.add_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # "--config" would look like an option of ours to argparse: hand everything after the
    # command to the configuration loader as items.
    if argv and argv[0] in _COMMANDS and not {"-h", "--help"} & set(argv[1:]):
        args = argparse.Namespace(command=argv[0], items=argv[1:],
                                  run=_config_command if argv[0] == "config" else _stage_command)
    else:
        args = _parser().parse_args(argv)
    if args.command in _COMMANDS:
        _import_from_current_folder()
    from xtrainer.config import ConfigError
    from xtrainer.launch import interrupts
    from xtrainer.launch.hang_monitor import RunHung

    try:
        return args.run(args)
    except (interrupts.TrainingInterrupted, RunHung) as err:
        print(f"xtrainer {args.command}: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    except ConfigError as err:
        print(f"xtrainer {args.command}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except Exception as err:
        if not _is_checkpoint_error(err):
            raise
        print(f"xtrainer {args.command}: error: {err}", file=sys.stderr)
        return 1


def _import_from_current_folder() -> None:
    """Let a configuration's ``_target_`` name a module of the current folder, as ``python -m``
    would, for the commands that read a configuration (only those: ``xtrainer consolidate`` run
    in a downloaded run folder must not import a ``yaml.py`` it holds). The folder goes last on
    the import path, so a file in it never replaces an installed module (a ``torch.py`` or
    ``yaml.py`` there is not imported in their place)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def _is_checkpoint_error(err: BaseException) -> bool:
    """Whether ``err`` is a ``CheckpointError`` (without importing the checkpoint package, and
    torch with it, when nothing could have raised one)."""
    module = sys.modules.get("xtrainer.checkpoint.format")
    return module is not None and isinstance(err, module.CheckpointError)


if __name__ == "__main__":
    sys.exit(main())
