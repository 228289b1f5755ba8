"""The ``xtrainer`` command.

    xtrainer fit --config run.yaml [key=value ...]       # also validate, test, predict
    xtrainer config --config run.yaml [key=value ...]    # print the resolved configuration
    xtrainer consolidate CHECKPOINT_DIR -o full.pt       # one state dict from a sharded folder

A configuration mistake is a one-line message and exit code 2, before anything trains. A fit
writes the resolved configuration to ``<run folder>/config.yaml``; ``xtrainer fit --config`` on
that file runs the same configuration again.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from xtrainer import checkpoint as ckpt_io
from xtrainer import interrupts
from xtrainer import config as cfg_io

_STAGES = ("fit", "validate", "test", "predict")
_EXAMPLE = "examples: --config run.yaml   --config base.yaml --config small.yaml trainer.max_epochs=3 model.lr=1e-3"


def run_stage(stage: str, config: cfg_io.RunConfig) -> tuple[Any, Any]:
    """Build the run ``config`` describes and run ``stage``; returns (trainer, what it returned)."""
    run = cfg_io.build(config, stage)
    trainer, data = run.trainer, run.data
    loaders = {name: _dataloader(data, name) for name in ("train", "val", "test", "predict")}
    if stage == "fit":
        _check_train_batches(config, loaders["train"])
    # The saved configuration names the checkpoint actually used (not "last"), so running it
    # again starts from the same state.
    config.ckpt_path = trainer.resolve_ckpt_path(run.ckpt_path)
    path = cfg_io.save_config(config, trainer.log_dir)
    print(f"xtrainer {stage}: run folder {trainer.log_dir} (configuration: {path})", flush=True)
    if stage == "fit":
        return trainer, trainer.fit(run.model, loaders["train"], loaders["val"], ckpt_path=run.ckpt_path)
    if stage == "validate":
        return trainer, trainer.validate(run.model, loaders["val"], ckpt_path=run.ckpt_path)
    if stage == "test":
        return trainer, trainer.test(run.model, loaders["test"], ckpt_path=run.ckpt_path)
    return trainer, trainer.predict(run.model, loaders["predict"], ckpt_path=run.ckpt_path)


def _dataloader(data: Any, name: str) -> Any:
    """``data.<name>_dataloader()`` (None without one); a ``ValueError`` or ``TypeError`` from it, such
    as a DataLoader refusing ``batch_size=0``, is a mistake in ``data``'s arguments."""
    method = getattr(data, f"{name}_dataloader", None)
    if method is None:
        return None
    try:
        return method()
    except (TypeError, ValueError) as err:
        raise cfg_io.ConfigError(f"data: {type(data).__name__}.{name}_dataloader() failed: "
                                 f"{' '.join(str(err).split())}") from None


def _check_train_batches(config: cfg_io.RunConfig, loader: Any) -> None:
    """Refuse a ``trainer.limit_train_batches`` fraction that leaves none of the loader's batches."""
    limit = getattr(config.trainer, "limit_train_batches", 1.0)
    try:
        length = len(loader)
    except TypeError:
        return
    if isinstance(limit, float) and 0.0 < limit < 1.0 and length > 0 and int(length * limit) == 0:
        raise cfg_io.ConfigError(f"trainer.limit_train_batches={limit} leaves none of the {length} training batches: "
                                 "give a larger fraction or a number of batches.")


def _stage_command(args: argparse.Namespace) -> int:
    config = cfg_io.load(args.items)
    trainer, result = run_stage(args.command, config)
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
    print(cfg_io.to_yaml(cfg_io.load(args.items)), end="")
    return 0


def _consolidate_command(args: argparse.Namespace) -> int:
    source, output = os.path.realpath(args.checkpoint), os.path.realpath(args.output)
    if output == source or output.startswith(source.rstrip(os.sep) + os.sep):
        raise ckpt_io.CheckpointError(f"-o {args.output} would overwrite the checkpoint it reads ({args.checkpoint}); "
                                      "write the consolidated weights somewhere else.")
    state_dict = ckpt_io.consolidate(args.checkpoint)
    ckpt_io.storage.write_file(state_dict, args.output, advice="Nothing was written; the checkpoint is intact.")
    total = sum(t.numel() for t in state_dict.values())
    print(f"wrote {args.output}: {len(state_dict)} tensors, {total:,} values. "
          "Load it with module.load_state_dict(torch.load(path)).")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xtrainer", description="Train PyTorch models on XLA devices.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for stage in (*_STAGES, "config"):
        what = "print the resolved configuration (defaults included)" if stage == "config" else \
            f"{stage} the model a configuration describes"
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
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # "--config" would look like an option of ours to argparse: hand everything after the
    # command to the configuration loader as items.
    if argv and argv[0] in (*_STAGES, "config") and not {"-h", "--help"} & set(argv[1:]):
        args = argparse.Namespace(command=argv[0], items=argv[1:],
                                  run=_config_command if argv[0] == "config" else _stage_command)
    else:
        args = _parser().parse_args(argv)
    # Targets are imported as `python -m` would: from the current folder too.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return args.run(args)
    except interrupts.TrainingInterrupted as err:
        print(f"xtrainer {args.command}: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    except (cfg_io.ConfigError, ckpt_io.CheckpointError) as err:
        message = " ".join(str(err).split()) if isinstance(err, cfg_io.ConfigError) else err
        print(f"xtrainer {args.command}: error: {message}", file=sys.stderr)
        return 2 if isinstance(err, cfg_io.ConfigError) else 1


if __name__ == "__main__":
    sys.exit(main())
