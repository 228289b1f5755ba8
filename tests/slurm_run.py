"""The fit of ``native_run.py`` (``ExactNet``: exact sums, so a resumed run is bitwise equal to one
never stopped) as a SLURM task runs it: started by ``srun``, its ranks and master from SLURM's
variables, no torch variable set (or by the batch script itself, starting ``--devices`` processes)::

    srun -N 2 --ntasks-per-node=2 python slurm_run.py --root ROOT --out OUT.pt [--steps N]
        [--pause SECONDS] [--ready FILE] [--devices D|auto] [--num-nodes N] [--no-requeue]
        [--stage validate]

``OUT.pt`` (rank 0): the final weights, the step, the world size, the run folder, the job's
``SLURM_RESTART_COUNT`` and the checkpoint the fit resumed from. Exits 128 + signal when a signal
stopped the fit (after a line ``rank R: Stopped by ... at step N ...``), 2 with the error's one
line on stderr (``refused: ...``) when the Trainer refused the job. ``--stage validate``: the
module's ``trainer.validate`` over the same data instead (``--pause`` seconds per batch, ``--ready``
written at the second batch of a job's first run), ``OUT.pt`` holding ``val_loss``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.utils.data import DataLoader

import native_run
from xtrainer import Trainer, TrainingInterrupted
from xtrainer.callbacks import Callback
from xtrainer.plugins.environments import SLURMEnvironment


class SlowValidation(Callback):
    """``seconds`` per validation batch; ``ready`` written at the second batch of the job's first run."""

    def __init__(self, seconds: float, ready: str | None) -> None:
        self.seconds, self.ready = seconds, ready

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        time.sleep(self.seconds)
        first_run = os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
        if self.ready and batch_idx == 1 and trainer.is_global_zero and first_run:
            with open(self.ready, "w") as f:
                f.write(str(os.getpid()))


def validate(args: argparse.Namespace, devices, plugins) -> tuple[Trainer, dict]:
    world = int(os.environ["SLURM_NTASKS"]) if "SLURM_STEP_ID" in os.environ else int(devices)
    loader = DataLoader(native_run.make_data(), batch_size=8 // world)
    trainer = Trainer(strategy="native_ddp", devices=devices, num_nodes=args.num_nodes, default_root_dir=args.root,
                      enable_progress_bar=False, enable_model_summary=False, logger=False, plugins=plugins,
                      callbacks=[SlowValidation(args.pause, args.ready)])
    (results,) = trainer.validate(native_run.ExactNet(), loader, verbose=False)
    return trainer, results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--pause", type=float, default=0.0)
    parser.add_argument("--ready", default=None)
    parser.add_argument("--devices", default="auto")
    parser.add_argument("--num-nodes", type=int, default=int(os.environ.get("SLURM_NNODES", "1")))
    parser.add_argument("--no-requeue", action="store_true")
    parser.add_argument("--stage", default="fit", choices=("fit", "validate"))
    args = parser.parse_args()
    devices = args.devices if args.devices == "auto" else int(args.devices)
    # srun's tasks are the replicas; the batch script's own process starts devices processes
    world = int(os.environ["SLURM_NTASKS"]) if "SLURM_STEP_ID" in os.environ else int(devices)
    plugins = [SLURMEnvironment(auto_requeue=False)] if args.no_requeue else None
    try:
        if args.stage == "validate":
            trainer, results = validate(args, devices, plugins)
            if trainer.is_global_zero:
                torch.save({"val_loss": results["val_loss"], "restarts": int(os.environ.get("SLURM_RESTART_COUNT", "0"))},
                           args.out)
            return
        trainer, model = native_run.fit("native_ddp", devices, args.root, args.steps, 8, None, args.pause,
                                        args.ready, world_size=world, num_nodes=args.num_nodes, plugins=plugins)
    except TrainingInterrupted as err:
        print(f"rank {os.environ.get('SLURM_PROCID')}: {err}", file=sys.stderr, flush=True)
        sys.exit(err.exit_code)
    except ValueError as err:
        print(f"refused: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    if trainer.is_global_zero:
        torch.save({"weights": native_run.whole_weights(model), "global_step": trainer.global_step,
                    "world_size": trainer.world_size, "log_dir": trainer.log_dir,
                    "restarts": int(os.environ.get("SLURM_RESTART_COUNT", "0")), "resumed_from": trainer.ckpt_path},
                   args.out)


if __name__ == "__main__":
    main()
