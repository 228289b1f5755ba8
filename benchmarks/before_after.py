"""What a change costs, measured side by side: contenders of ``run.py`` from two checkouts of the
project, interleaved in one run.

    git worktree add --detach /tmp/before <commit>
    python benchmarks/before_after.py /tmp/before . --contenders native native_ddp eager eager_ddp --pin

Every repeat runs each contender once from each checkout (``run.py --one``, a process of its own,
its working directory and ``PYTHONPATH`` that checkout's), the checkouts' order alternating from
repeat to repeat, so that a drift of the machine falls on both sides. Per contender it prints the
ratio after/before of the CPU time per step, paired within a repeat (median and range over the
repeats; below 1: the change costs less), and each side's best. The hand-written loops (``eager``,
``eager_ddp``) are the control: their code is the same on both sides, so their ratio shows the
noise that a contender's ratio must be read against.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def measure(tree: str, workload: str, contender: str, steps: int, pin: bool) -> dict | None:
    """One ``run.py --one`` measurement, from the checkout ``tree``."""
    devices = 2 if "_ddp" in contender else 1
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    if pin:
        env["XTRAINER_BENCH_PIN"] = "1"
    cmd = [sys.executable, os.path.join(tree, "benchmarks", "run.py"), "--one", workload, contender, str(steps),
           "10", str(devices), "10"]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        print(f"  {contender} from {tree} failed:\n{done.stderr[-1500:]}", flush=True)
        return None
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", help="the checkout before the change")
    parser.add_argument("after", help="the checkout after it")
    parser.add_argument("--contenders", nargs="+", default=["native", "native_ddp", "eager", "eager_ddp"])
    parser.add_argument("--workload", default="mlp")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--pin", action="store_true", help="as run.py --pin: each process on a core of its own")
    args = parser.parse_args()
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    cpu: dict[tuple[str, str], dict[int, float]] = {}
    for r in range(args.repeats):
        sides = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for contender in args.contenders:
            for side in sides:
                out = measure(trees[side], args.workload, contender, args.steps, args.pin)
                if out is not None:
                    cpu.setdefault((contender, side), {})[r] = out["cpu_ms_per_step"]
                    print(f"repeat {r} {contender:<12} {side:<6} {out['cpu_ms_per_step']:8.3f} CPU ms/step", flush=True)
    print(f"\n{args.workload}, {args.steps} steps, {args.repeats} repeats{', pinned' if args.pin else ''}: "
          f"CPU ms per step (best), and after/before paired within a repeat")
    print("| contender | before (best) | after (best) | after/before, median (range) | pairs |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for contender in args.contenders:
        before, after = cpu.get((contender, "before"), {}), cpu.get((contender, "after"), {})
        ratios = [after[r] / before[r] for r in sorted(set(before) & set(after))]
        if not ratios:
            print(f"| {contender} | - | - | - | 0 |")
            continue
        print(f"| {contender} | {min(before.values()):.3f} | {min(after.values()):.3f} | "
              f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) | {len(ratios)} |")


if __name__ == "__main__":
    main()
