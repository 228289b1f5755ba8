"""The SLURM-requeue contender of the recovery benchmark (``benchmarks/recovery.py``): a lost worker
recovered by requeueing the job, on a real SLURM cluster on this machine
(``tests/slurm_cluster.py``: slurmctld and two slurmd nodes on 127.0.0.1)::

    python benchmarks/recovery_slurm.py [--trials 3] [--steps 300] [--seed 0]

A two-node job (one task per node, ``native_ddp`` over gloo, ``benchmarks/recovery_slurm_job.py``:
the fit of ``recovery.py``'s torchrun contender, a checkpoint every 10 steps) whose batch script
requeues it when ``srun`` fails (``srun ... || scontrol requeue $SLURM_JOB_ID``). One task is SIGKILLed at a random step; the
requeued job is released as soon as SLURM lets it start (``PENDING`` plus 2 s:
``scontrol update jobid=J StartTime=now``) and resumes from ``last``. Measured per trial: the
time from the kill to the first step the resumed job trains, and its parts (the survivor's
failure and the requeue, the wait until SLURM may release the job, the start and restore); the
steps lost (trained before the kill, trained again after it); and the hold SLURM puts on a
requeued job (its ``EligibleTime``, about 121 s after the requeue), which a job that no one
releases waits on top.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import slurm_cluster  # noqa: E402


def _steps(folder: Path, rank: int) -> list[tuple[float, int, int]]:
    """Rank ``rank``'s ``(time, global step, restart count)`` of every step it finished."""
    path = folder / f"steps-{rank}"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            rows.append((float(parts[0]), int(parts[1]), int(parts[2])))
    return rows


def _epoch(text: str) -> float | None:
    try:
        return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp()
    except (TypeError, ValueError):
        return None


def trial(cluster: slurm_cluster.Cluster, folder: Path, steps: int, rng: random.Random) -> dict:
    """One job, one kill, one requeue: its figures."""
    folder.mkdir(parents=True)
    env = dict(cluster.env, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    script = "\n".join([
        "#!/bin/bash",
        "#SBATCH --nodes=2 --ntasks-per-node=1 --requeue --open-mode=append",
        f"#SBATCH --output={folder}/job.out",
        f"srun --kill-on-bad-exit=1 {sys.executable} {REPO / 'benchmarks' / 'recovery_slurm_job.py'} {folder} {steps}"
        " || scontrol requeue $SLURM_JOB_ID",
        "",
    ])
    path = folder / "job.sh"
    path.write_text(script)
    job = cluster.run(["sbatch", "--parsable", str(path)], env=env, cwd=folder).stdout.strip()
    kill_at = rng.randint(15, max(16, steps // 2))
    victim = rng.randint(0, 1)
    deadline = time.monotonic() + 300
    while not (rows := _steps(folder, 0)) or rows[-1][1] < kill_at:
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job} did not reach step {kill_at}: {cluster.job(job)}")
        time.sleep(0.01)
    before = _steps(folder, 0)[-1][1]
    t_kill = time.time()
    os.kill(int((folder / f"pid-{victim}").read_text()), signal.SIGKILL)
    info = cluster.wait_state(job, ("PENDING",), 120)
    t_pending = time.time()
    eligible = _epoch(info.get("EligibleTime", ""))
    time.sleep(2.0)  # sooner, and the released job fails ("Job credential revoked")
    cluster.run(["scontrol", "update", f"jobid={job}", "StartTime=now"])
    t_release = time.time()
    deadline = time.monotonic() + 300
    while not all(any(row[2] >= 1 for row in _steps(folder, rank)) for rank in (0, 1)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job} did not train after its requeue: {cluster.job(job)}")
        time.sleep(0.01)
    firsts = [min((row for row in _steps(folder, rank) if row[2] >= 1), key=lambda row: row[0]) for rank in (0, 1)]
    t_next, first_step = max(row[0] for row in firsts), firsts[0][1]
    done = cluster.wait_state(job, ("COMPLETED", "FAILED"), 300)
    if done["JobState"] != "COMPLETED":
        log = (folder / "job.out").read_text()[-2000:]
        raise RuntimeError(f"job {job} {done['JobState']} after its requeue: {log}")
    return {"killed_after_step": before, "kill_to_next_step_s": round(t_next - t_kill, 2),
            "steps_lost": before - (first_step - 1), "shards_skipped": 0,
            "kill_to_pending_s": round(t_pending - t_kill, 2), "pending_to_release_s": round(t_release - t_pending, 2),
            "release_to_next_step_s": round(t_next - t_release, 2),
            "slurm_hold_s": None if eligible is None else round(eligible - t_pending, 1)}


def slurm_requeue(trials: int = 3, steps: int = 300, seed: int = 0) -> list[dict]:
    """The SLURM-requeue contender: ``trials`` jobs on a cluster brought up for them."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="xt-recovery-slurm-") as tmp, \
            slurm_cluster.cluster(Path(tmp) / "cluster") as cluster:
        return [{"trial": i, **trial(cluster, Path(tmp) / f"trial-{i}", steps, rng)} for i in range(trials)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for row in slurm_requeue(args.trials, args.steps, args.seed):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
