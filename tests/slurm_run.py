"""The fit of ``native_run.py`` (``ExactNet``: exact sums, so a resumed run is bitwise equal to one
never stopped) as a SLURM task runs it: started by ``srun``, its ranks and master from SLURM's
variables, no torch variable set (or by the batch script itself, starting ``--devices`` processes)::

    srun -N 2 --ntasks-per-node=2 python slurm_run.py --root ROOT --out OUT.pt [--steps N]
        [--pause SECONDS] [--ready FILE] [--devices D|auto] [--num-nodes N] [--no-requeue]

``OUT.pt`` (rank 0): the final weights, the step, the world size, the run folder, the job's
``SLURM_RESTART_COUNT`` and the checkpoint the fit resumed from. Exits 128 + signal when a signal
stopped the fit (after a line ``rank R: Stopped by ... at step N ...``), 2 with the error's one
line on stderr (``refused: ...``) when the Trainer refused the job.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import native_run
from xtrainer import TrainingInterrupted
from xtrainer.plugins.environments import SLURMEnvironment


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
    args = parser.parse_args()
    devices = args.devices if args.devices == "auto" else int(args.devices)
    # srun's tasks are the replicas; the batch script's own process starts devices processes
    world = int(os.environ["SLURM_NTASKS"]) if "SLURM_STEP_ID" in os.environ else int(devices)
    plugins = [SLURMEnvironment(auto_requeue=False)] if args.no_requeue else None
    try:
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
