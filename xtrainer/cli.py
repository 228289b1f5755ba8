"""The ``xtrainer`` command: ``xtrainer consolidate CHECKPOINT_DIR -o full.pt``."""

from __future__ import annotations

import argparse
import sys

from xtrainer import checkpoint as ckpt_io


def consolidate_command(args: argparse.Namespace) -> int:
    state_dict = ckpt_io.consolidate(args.checkpoint)
    ckpt_io.save_file(state_dict, args.output)
    total = sum(t.numel() for t in state_dict.values())
    print(f"wrote {args.output}: {len(state_dict)} tensors, {total:,} values. "
          "Load it with module.load_state_dict(torch.load(path)).")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="xtrainer", description="xtrainer command-line tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    consolidate = commands.add_parser(
        "consolidate", help="stitch a sharded (xla_fsdp) checkpoint folder into one plain state dict")
    consolidate.add_argument("checkpoint", help="the checkpoint folder (holds trainer.pt and rank-*-of-*.pt)")
    consolidate.add_argument("-o", "--output", required=True, help="where to write the state dict (.pt)")
    consolidate.set_defaults(run=consolidate_command)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ckpt_io.CheckpointError as err:
        print(f"xtrainer {args.command}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
