"""A lost worker: live recovery (``native_ft`` on torchft) against a restart from the checkpoint
(``torchrun --max-restarts`` with ``ckpt_path="last"``), and the steady-state cost of fault
tolerance against plain ``native_ddp``::

    python benchmarks/recovery.py [--trials 2] [--steps 300] [--seed 0] [--only NAME ...] [--write]

Every contender trains the same tiny regressor on two workers (two processes of one torchrun job,
or two replica groups under one lighthouse), 4 samples each per step, pausing ``--pause`` seconds
per step so that the job outlives its recovery. A worker is SIGKILLed after a random step (15 to
half the run, drawn from ``--seed``); measured per trial:

- ``kill_to_next_step_s``: from the kill to the end of the next step trained by the whole job
  (every worker in it: the restarted torchrun job's first step; the restarted replica group's first
  step, which its survivor trains with it);
- ``survivor_stall_s`` (torchft): from the kill to the survivor's next step, trained alone;
- ``steps_lost``: steps whose work is gone: trained before the kill and again after the restart
  (torchrun), or not committed (torchft: the step the victim died in; no group trains its batches);
- ``shards_skipped`` (torchft): steps of the victim's shard that no one trained while it was away
  (the data rule of ``xtrainer/strategies/native_ft.py``).

The restart policy is the same for both: the victim's replacement starts as soon as it is seen
dead (torchrun's agent with ``--monitor-interval=0.1``; this script for the replica group, as a
supervisor would). ``compile=True`` runs the module through torch.compile, with the compilation
cache (``Trainer(compilation_cache=True)``: the restart finds the first attempt's Inductor
artifacts) or without (``compilation_cache=False`` and ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``).

The steady state runs 400 steps without pauses or kills under ``native_ddp`` (torchrun, two
processes) and ``native_ft`` (two groups and the lighthouse): wall time per step and CPU time per
step (every process of the job, the lighthouse included), and their ratios, in the same run.

``CONTENDERS`` is the table of recovery contenders: a name, what it is, and a function
``(trials, steps, seed) -> [row, ...]`` whose rows hold at least ``kill_to_next_step_s`` and
``steps_lost``. ``slurm_requeue`` (``benchmarks/recovery_slurm.py``) is one of them: it needs the
SLURM packages, which its own script installs and brings up (``--only slurm_requeue`` runs it).
``--write`` appends the table to ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

PAUSE = 0.05  # seconds per step while a recovery is measured (as benchmarks/recovery_slurm.py)
EVERY = 10  # torchrun: a checkpoint every 10 steps (as benchmarks/recovery_slurm.py)


# ---------------------------------------------------------------------------------------------
# The torchrun worker: python benchmarks/recovery.py --worker FOLDER STEPS [--compile] [--cache on|off]
# ---------------------------------------------------------------------------------------------
def worker(folder: str, steps: int, compile_: bool, cache: bool, pause: float) -> None:
    """One process of the torchrun job: the regressor of tests/ft_group.py under ``native_ddp``,
    resumed from ``last``. Each rank appends ``<time> <cpu> <global step> <restart count>`` to
    ``FOLDER/steps-<rank>`` at every step's end and writes ``FOLDER/pid-<rank>``."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from ft_group import FEATURES, dataset
    from xtrainer import Trainer, XModule, seed_everything
    from xtrainer.callbacks import Callback, ModelCheckpoint
    from xtrainer.strategies.native_ddp import NativeDDP

    class Regressor(XModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(FEATURES, 1)

        def training_step(self, batch, batch_idx):
            _, x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class Clock(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if pause:
                time.sleep(pause)
            rank = trainer.global_rank
            if not os.path.exists(os.path.join(folder, f"pid-{rank}-{os.getpid()}")):
                with open(os.path.join(folder, f"pid-{rank}-{os.getpid()}"), "w") as f:
                    f.write(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            with open(os.path.join(folder, f"steps-{rank}"), "a") as f:
                f.write(f"{time.time():.6f} {time.process_time():.6f} {trainer.global_step} "
                        f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}\n")

    seed_everything(1)
    callbacks = [Clock()] + ([ModelCheckpoint(every_n_train_steps=EVERY, save_last=True)] if pause else [])
    trainer = Trainer(strategy=NativeDDP(compile=compile_), max_steps=steps, max_epochs=1,
                      default_root_dir=os.path.join(folder, "runs"), logger=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, enable_checkpointing=bool(pause),
                      compilation_cache=cache, callbacks=callbacks)
    trainer.fit(Regressor(), DataLoader(dataset(), batch_size=4), ckpt_path="last" if pause else None)


def _rows(folder: Path, rank: int) -> list[tuple[float, float, int, int]]:
    path = folder / f"steps-{rank}"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 4:
            rows.append((float(parts[0]), float(parts[1]), int(parts[2]), int(parts[3])))
    return rows


def _wait(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _env(cache: bool) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    if not cache:
        env["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
    return env


def torchrun_restart(trials: int, steps: int, seed: int, compile_: bool = False, cache: bool = True) -> list[dict]:
    """``torchrun --nproc-per-node=2 --max-restarts=1``: rank 1 SIGKILLed, the agent stops rank 0
    and starts both again, which resume from ``last`` (a checkpoint every ``EVERY`` steps)."""
    from conftest import torchrun

    rng, out = random.Random(seed), []
    for trial in range(trials):
        with tempfile.TemporaryDirectory(prefix="xt-recovery-torchrun-") as tmp:
            folder = Path(tmp)
            cmd = torchrun("--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.1", __file__,
                           "--worker", str(folder), str(steps), *(["--compile"] if compile_ else []),
                           "--cache", "on" if cache else "off")
            log = open(folder / "log.txt", "w")
            job = subprocess.Popen(cmd, env=_env(cache), stdout=log, stderr=subprocess.STDOUT)
            kill_at = rng.randint(15, max(16, steps // 2))
            _wait(lambda: any(r[2] >= kill_at for r in _rows(folder, 0)) or job.poll() is not None, 300,
                  f"step {kill_at}")
            [pid_file] = glob.glob(str(folder / "pid-1-*"))
            before = max(r[2] for r in _rows(folder, 0))
            t_kill = time.time()
            os.kill(int(pid_file.rsplit("-", 1)[1]), signal.SIGKILL)
            _wait(lambda: all(any(r[3] >= 1 for r in _rows(folder, k)) for k in (0, 1)) or job.poll() is not None,
                  300, "the restarted job's first step")
            firsts = [min((r for r in _rows(folder, k) if r[3] >= 1), key=lambda r: r[0]) for k in (0, 1)]
            t_next, first_step = max(r[0] for r in firsts), firsts[0][2]
            job.wait(timeout=600)
            if job.returncode != 0:
                raise RuntimeError(f"torchrun failed ({job.returncode}): {(folder / 'log.txt').read_text()[-2000:]}")
            out.append({"trial": trial, "killed_after_step": before, "kill_to_next_step_s": round(t_next - t_kill, 2),
                        "steps_lost": before - (first_step - 1), "shards_skipped": 0})
    return out


def _ft_records(folder: Path, group: int) -> list[dict]:
    path = folder / f"trained-{group}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _ft_group(folder: Path, group: int, lighthouse: str, steps: int, pause: float, compile_: bool,
              cache: bool) -> subprocess.Popen:
    log = open(folder / f"log-{group}-{time.monotonic_ns()}.txt", "w")
    return subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "ft_group.py"), str(folder), str(group), "2", "--lighthouse", lighthouse,
         "--max-steps", str(steps), "--epochs", "-1", "--slow", str(pause), *(["--compile"] if compile_ else []),
         "--cache", "on" if cache else "off"],
        env=_env(cache), stdout=log, stderr=subprocess.STDOUT)


def torchft_recovery(trials: int, steps: int, seed: int, compile_: bool = False, cache: bool = True) -> list[dict]:
    """Two replica groups of ``native_ft``; group 1 SIGKILLed and started again at once; it heals
    from group 0, which trains on alone meanwhile (after the lighthouse's heartbeat timeout)."""
    import torch

    from ft_lighthouse import running_lighthouse

    rng, out = random.Random(seed), []
    for trial in range(trials):
        with tempfile.TemporaryDirectory(prefix="xt-recovery-torchft-") as tmp, \
                running_lighthouse(heartbeat_timeout_ms=1000) as lighthouse:
            folder = Path(tmp)
            (folder / "slow").touch()
            # no end of their own: they stop together at the step stop_at names once the victim is back
            groups = [_ft_group(folder, g, lighthouse.address, 10 ** 6, PAUSE, compile_, cache) for g in (0, 1)]
            kill_at = rng.randint(15, max(16, steps // 2))
            _wait(lambda: any(r["step"] >= kill_at for r in _ft_records(folder, 1))
                  or any(p.poll() is not None for p in groups), 300, f"step {kill_at}")
            before = max(r["step"] for r in _ft_records(folder, 1))
            t_kill = time.time()
            groups[1].kill()
            groups[1].wait()
            restarted = _ft_group(folder, 1, lighthouse.address, 10 ** 6, PAUSE, compile_, cache)
            _wait(lambda: any(r["pid"] == restarted.pid for r in _ft_records(folder, 1))
                  or restarted.poll() is not None, 300, "the restarted group's first step")
            mine = [r for r in _ft_records(folder, 1) if r["pid"] == restarted.pid]
            t_next, back_at = mine[0]["time"], mine[0]["step"]
            stall = min(r["time"] for r in _ft_records(folder, 0) if r["time"] > t_kill) - t_kill
            (folder / "stop_at").write_text(str(max(r["step"] for r in _ft_records(folder, 0)) + 10))
            (folder / "slow").unlink()
            for proc in (groups[0], restarted):
                proc.wait(timeout=600)
            if groups[0].returncode != 0 or restarted.returncode != 0:
                logs = "".join(p.read_text()[-1500:] for p in folder.glob("log-*.txt"))
                raise RuntimeError(f"a group failed: {logs}")
            [survivor] = [torch.load(p) for p in folder.glob("result-0-*.pt")]
            died_at = before + 1  # the first step the victim did not finish
            if back_at <= died_at:
                raise RuntimeError(f"the restarted group began at step {back_at}: it did not heal from the survivor")
            out.append({"trial": trial, "killed_after_step": before, "kill_to_next_step_s": round(t_next - t_kill, 2),
                        "survivor_stall_s": round(stall, 2), "steps_lost": len(survivor["uncommitted_steps"]),
                        "shards_skipped": back_at - died_at})
    return out


def slurm_requeue(trials: int, steps: int, seed: int) -> list[dict]:
    """``benchmarks/recovery_slurm.py``'s contender (SLURM's packages and a local cluster)."""
    return importlib.import_module("recovery_slurm").slurm_requeue(trials, steps, seed)


@dataclass
class Contender:
    name: str
    what: str
    run: Callable[[int, int, int], list[dict]]


#: The recovery contenders, in the table's order: add a row here for another way back.
CONTENDERS: list[Contender] = [
    Contender("torchft", "native_ft, 2 replica groups: the survivor trains on, the restarted group heals from it",
              torchft_recovery),
    Contender("torchft_compile", "the same, compile=True, with the compilation cache",
              lambda t, s, r: torchft_recovery(t, s, r, compile_=True, cache=True)),
    Contender("torchrun_restart", "torchrun --max-restarts=1, native_ddp x2, ckpt_path='last'", torchrun_restart),
    Contender("torchrun_restart_compile_nocache", "the same, compile=True, without the compilation cache",
              lambda t, s, r: torchrun_restart(t, s, r, compile_=True, cache=False)),
    Contender("torchrun_restart_compile_cache", "the same, compile=True, with the compilation cache",
              lambda t, s, r: torchrun_restart(t, s, r, compile_=True, cache=True)),
    Contender("slurm_requeue", "sbatch --requeue, native_ddp on 2 nodes, ckpt_path='last' (recovery_slurm.py)",
              slurm_requeue),
]
#: Run unless --only names them (SLURM needs its packages and a cluster of its own).
DEFAULT = [c.name for c in CONTENDERS if c.name != "slurm_requeue"]


# ---------------------------------------------------------------------------------------------
# The steady state
# ---------------------------------------------------------------------------------------------
def _cpu_of(pid: int) -> float:
    """A process's CPU seconds so far (user + system, /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def steady_state(steps: int = 500, skip: int = 50) -> dict:
    """Per-step wall and CPU time, steps ``skip`` to ``steps`` (start-up excluded), of
    ``native_ddp`` x2 and ``native_ft`` x2 (with its lighthouse's CPU)."""
    from conftest import torchrun
    from ft_lighthouse import running_lighthouse

    figures = {}
    with tempfile.TemporaryDirectory(prefix="xt-steady-ddp-") as tmp:
        folder = Path(tmp)
        with open(folder / "log.txt", "w") as log:
            done = subprocess.run(torchrun("--nproc-per-node=2", __file__, "--worker", str(folder), str(steps),
                                           "--pause", "0"), env=_env(True), stdout=log, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise RuntimeError(f"native_ddp failed ({done.returncode}): {(folder / 'log.txt').read_text()[-1500:]}")
        per = [[r for r in _rows(folder, k) if r[2] > skip] for k in (0, 1)]
        n = per[0][-1][2] - per[0][0][2]
        figures["native_ddp"] = {"wall_ms": (per[0][-1][0] - per[0][0][0]) / n * 1e3,
                                 "cpu_ms": sum(rows[-1][1] - rows[0][1] for rows in per) / n * 1e3}
    with tempfile.TemporaryDirectory(prefix="xt-steady-ft-") as tmp, running_lighthouse() as lighthouse:
        folder = Path(tmp)
        groups = [_ft_group(folder, g, lighthouse.address, steps, 0.0, False, True) for g in (0, 1)]
        _wait(lambda: all(_ft_records(folder, g) for g in (0, 1)), 300, "both groups' first steps")
        house_0 = _cpu_of(lighthouse.process.pid)
        for proc in groups:
            proc.wait(timeout=600)
        house = _cpu_of(lighthouse.process.pid) - house_0
        # the steps both groups trained (one may have trained alone before the other came up)
        common = set.intersection(*({r["step"] for r in _ft_records(folder, g)} for g in (0, 1)))
        start = min(common) + skip
        per = [[r for r in _ft_records(folder, g) if r["step"] in common and r["step"] > start] for g in (0, 1)]
        n = per[0][-1]["step"] - per[0][0]["step"]
        figures["native_ft"] = {"wall_ms": (per[0][-1]["time"] - per[0][0]["time"]) / n * 1e3,
                                "cpu_ms": (sum(rows[-1]["cpu"] - rows[0]["cpu"] for rows in per) + house) / n * 1e3,
                                "lighthouse_cpu_ms": house / n * 1e3}
    return figures


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------
def _median(rows: list[dict], key: str) -> str:
    values = [r[key] for r in rows if r.get(key) is not None]
    return f"{statistics.median(values):g}" if values else "-"


def table(results: dict[str, list[dict]], steady: dict | None, args: argparse.Namespace) -> str:
    lines = [f"Recovery: {args.trials} trial(s) per contender, {args.steps} steps, a kill after a random step "
             f"(seed {args.seed}), {PAUSE} s pause per step; medians (each trial's figures below).", "",
             "| contender | kill to the job's next step (s) | survivor's stall (s) | steps lost | shards skipped |",
             "| --- | --- | --- | --- | --- |"]
    for contender in CONTENDERS:
        rows = results.get(contender.name)
        if rows is None:
            continue
        if isinstance(rows, str):
            lines.append(f"| {contender.name} | {rows} | | | |")
            continue
        lines.append(f"| {contender.name} | {_median(rows, 'kill_to_next_step_s')} | {_median(rows, 'survivor_stall_s')} "
                     f"| {_median(rows, 'steps_lost')} | {_median(rows, 'shards_skipped')} |")
    lines += ["", "Each trial: " + "; ".join(
        f"{name}: " + ", ".join(f"{r['kill_to_next_step_s']} s" for r in rows)
        for name, rows in results.items() if not isinstance(rows, str))]
    if steady:
        ddp, ft = steady["native_ddp"], steady["native_ft"]
        lines += ["", "Steady state, 2 workers, no pause (500 steps; the first 50 the two trained together not counted):", "",
                  "| | native_ddp | native_ft | ratio |", "| --- | --- | --- | --- |",
                  f"| wall per step (ms) | {ddp['wall_ms']:.2f} | {ft['wall_ms']:.2f} | {ft['wall_ms'] / ddp['wall_ms']:.2f} |",
                  f"| CPU per step, all processes (ms) | {ddp['cpu_ms']:.2f} | {ft['cpu_ms']:.2f} "
                  f"| {ft['cpu_ms'] / ddp['cpu_ms']:.2f} |",
                  f"| of which the lighthouse (ms) | - | {ft['lighthouse_cpu_ms']:.3f} | |"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs=2, metavar=("FOLDER", "STEPS"), help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cache", choices=("on", "off"), default="on", help=argparse.SUPPRESS)
    parser.add_argument("--pause", type=float, default=PAUSE, help=argparse.SUPPRESS)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", default=None, help=f"contenders, of {[c.name for c in CONTENDERS]}, "
                        "and 'steady'")
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.compile, args.cache == "on", args.pause)
        return
    names = args.only if args.only is not None else [*DEFAULT, "steady"]
    unknown = set(names) - {c.name for c in CONTENDERS} - {"steady"}
    if unknown:
        parser.error(f"unknown contender(s) {sorted(unknown)}: give names of {[c.name for c in CONTENDERS]} or 'steady'")
    results: dict[str, list[dict] | str] = {}
    for contender in CONTENDERS:
        if contender.name in names:
            started = time.monotonic()
            try:
                results[contender.name] = contender.run(args.trials, args.steps, args.seed)
            except (ImportError, RuntimeError, OSError) as err:  # e.g. SLURM's packages missing
                results[contender.name] = f"not run: {str(err).splitlines()[0][:120]}"
            print(f"{contender.name} ({time.monotonic() - started:.0f} s): {results[contender.name]}", flush=True)
    steady = None
    if "steady" in names:
        try:
            steady = steady_state()
        except RuntimeError as err:
            print(f"steady state not measured: {err}", flush=True)
    text = table(results, steady, args)
    print(text)
    if args.write:
        with open(REPO / "benchmarks" / "RESULTS.md", "a") as f:
            f.write("\n## Recovery from a lost worker: torchft against a restart from the checkpoint (CPU, gloo)\n\n"
                    f"`python benchmarks/recovery.py {' '.join(sys.argv[1:])}`\n\n{text}\n")


if __name__ == "__main__":
    main()
