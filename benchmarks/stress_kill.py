"""Kill fits with SIGKILL at random moments, resume each from ``last`` until it finishes, and
compare the final weights with an uninterrupted run's, bitwise.

    python benchmarks/stress_kill.py [--runs 20] [--strategies xla_native:1,xla_fsdp:2,...] [--seed 0]

Each attempt starts ``tests/killable_run.py`` in its own process and kills it (the whole process
group: the replicas' process too) after a random delay between its start and the time a whole
fit takes, so kills land in imports, compilation, steps, validation and saves alike; then it
resumes from ``last`` in a new process, killing again at random, until a run completes. It
reports, per strategy, how many attempts ended bitwise equal, differed, or failed (with the
error), and where the kills landed in time.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import torch

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
SCRIPT = os.path.join(TESTS, "killable_run.py")


def start(strategy: str, devices: int, root: str, out: str, resume: bool) -> subprocess.Popen:
    args = [sys.executable, SCRIPT, strategy, root, str(devices), "never", "0", "last" if resume else "none", out]
    return subprocess.Popen(args, cwd=TESTS, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "PJRT_DEVICE": "CPU"})


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        return -999, "hung"
    return proc.returncode, err


def attempt(strategy: str, devices: int, reference: dict, full_time: float, rng: random.Random) -> tuple[str, str]:
    with tempfile.TemporaryDirectory(prefix="xtrainer-stress-") as tmp:
        root, out = os.path.join(tmp, "runs"), os.path.join(tmp, "final.pt")
        kills, resume = [], False
        while True:
            proc = start(strategy, devices, root, out, resume)
            if len(kills) < 3:  # at most three kills per attempt, then it must finish
                delay = rng.uniform(0.2, full_time)
                try:
                    proc.wait(timeout=delay)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)  # the script and the replicas' process with it
                    proc.wait()
                    kills.append(round(delay, 1))
                    resume = True
                    continue
            code, err = finish(proc, timeout=full_time * 4 + 120)
            if code != 0:
                return "failed", f"kills at {kills} s; exit {code}: {err.strip().splitlines()[-1] if err.strip() else ''}"
            final = torch.load(out, weights_only=True)
            same = all(torch.equal(final[k], v) for k, v in reference.items())
            return ("bitwise" if same else "differs"), f"kills at {kills} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--strategies", default="xla_native:1,xla_native:2,xla_ddp:2,xla_fsdp:1,xla_fsdp:2,"
                                                "xla_spmd:4,xla_fsdpv2:4")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    for item in args.strategies.split(","):
        strategy, devices = item.split(":")[0], int(item.split(":")[1])
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.monotonic()
            code, err = finish(start(strategy, int(devices), os.path.join(tmp, "runs"), os.path.join(tmp, "w.pt"),
                                     False), timeout=900)
            full_time = time.monotonic() - t0
            if code != 0:
                print(f"{item}: the uninterrupted run failed: {err[-2000:]}")
                continue
            reference = torch.load(os.path.join(tmp, "w.pt"), weights_only=True)
        tally: dict[str, int] = {}
        for i in range(args.runs):
            verdict, detail = attempt(strategy, devices, reference, full_time, rng)
            tally[verdict] = tally.get(verdict, 0) + 1
            print(f"{item} attempt {i + 1}: {verdict} ({detail})", flush=True)
        print(f"{item}: {tally} over {args.runs} attempts (an uninterrupted fit takes {full_time:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
