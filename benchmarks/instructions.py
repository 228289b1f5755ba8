"""Instructions per step of the native contenders and their hand-written loops, counted exactly.

    python benchmarks/instructions.py                                   # native_ddp and its hand loop
    python benchmarks/instructions.py --contenders eager native eager_ddp_compile native_ddp_compile

CPU time on a shared 2-core virtual machine moves by several percent from run to run (a DDP pair
mostly in system time: gloo's waits), more than the 3% the native strategies are held to. An
instruction count does not move: each contender runs as ``run.py --one`` does, under valgrind's
callgrind, with counting off until the mark after the warm-up and off again at the last mark, so
that only the steady state is counted (no start-up, no compilation). The figure is the
instructions per step of each process (their mean on two), and the contender's over its hand
loop's, minus 1. Instructions are not time: host code that misses the caches more (Python's, more
than torch's kernels) costs more time per instruction; ``run.py`` measures the time.

Needs ``valgrind`` (with ``callgrind_control``) on the PATH. A contender takes 5 to 15 minutes
(valgrind runs the start-up about 5 times slower, the counted steps about 50 times). Writes
``benchmarks/.runs/instructions.json``.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
#: contender -> the hand-written loop it is held to (as in run.py's native table)
HAND = {"native": "eager", "native_compile": "eager_compile", "native_ddp": "eager_ddp",
        "native_ddp_compile": "eager_ddp_compile"}


def count(contender: str, workload: str, warmup: int, counted: int, every: int) -> list[float]:
    """Instructions per counted step of each process of ``contender`` (the caller left out)."""
    devices = 2 if "_ddp" in contender else 1
    last = warmup + counted
    with tempfile.TemporaryDirectory(prefix="xtrainer-callgrind-") as out:
        # valgrind runs no AVX-512: torch's kernels and Inductor's (built with -march=native) keep to
        # AVX2, in a cache of their own; the compiler runs outside valgrind, in one process.
        compiler = os.path.join(out, "bin", "g++")
        os.makedirs(os.path.dirname(compiler))
        with open(compiler, "w") as f:
            f.write(f'#!/bin/sh\nexec {shutil.which("g++") or "g++"} "$@" -mno-avx512f\n')
        os.chmod(compiler, 0o755)
        env = dict(os.environ, XTRAINER_BENCH_CALLGRIND=f"{warmup},{last}", XTRAINER_BENCH_PIN="1",
                   OMP_NUM_THREADS="1", PJRT_DEVICE="CPU", ATEN_CPU_CAPABILITY="avx2", CXX=compiler,
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(out, "inductor"), TORCHINDUCTOR_COMPILE_THREADS="1")
        command = ["valgrind", "--tool=callgrind", "--trace-children=yes", "--instr-atstart=no",
                   "--trace-children-skip=*/g++,*/gcc,*/cc1plus,*/as,*/ld,*/collect2,*/x86_64-linux-gnu-*,*/sh",
                   f"--callgrind-out-file={out}/cg.%p", sys.executable, os.path.join(HERE, "run.py"), "--one",
                   workload, contender, str(last + every), str(warmup), str(devices), str(every)]
        run = subprocess.run(command, env=env, capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"{contender} failed under valgrind:\n{run.stderr[-3000:]}")
        totals = []
        for path in sorted(glob.glob(os.path.join(out, "cg.*.1"))):  # the dumps written at the last mark
            with open(path) as f:
                totals += [int(line.split()[1]) for line in f if line.startswith("totals:")]
    if len(totals) != devices:
        raise SystemExit(f"{contender}: expected {devices} counted process(es), found {len(totals)}")
    return [total / counted for total in totals]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contenders", nargs="+", default=["eager_ddp", "native_ddp"],
                        choices=sorted(set(HAND) | set(HAND.values())))
    parser.add_argument("--workload", default="mlp", choices=["mlp", "lm"])
    parser.add_argument("--warmup", type=int, default=50, help="steps before counting starts")
    parser.add_argument("--steps", type=int, default=200, help="steps counted")
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind (with callgrind_control) is not installed.")
    every = math.gcd(args.warmup, args.steps)  # host reads (marks) at the first and the last counted step
    counts = {}
    for contender in args.contenders:
        counts[contender] = count(contender, args.workload, args.warmup, args.steps, every)
        per = counts[contender]
        print(f"{contender:<20} {sum(per) / len(per) / 1e6:8.3f} M instructions/step "
              f"(processes: {', '.join(f'{x / 1e6:.3f}' for x in per)})", flush=True)
    for contender, hand in HAND.items():
        if contender in counts and hand in counts:
            mine, theirs = (sum(counts[c]) / len(counts[c]) for c in (contender, hand))
            print(f"{contender} over {hand}: {100 * (mine / theirs - 1):+.2f}% instructions per step", flush=True)
    os.makedirs(os.path.join(HERE, ".runs"), exist_ok=True)
    with open(os.path.join(HERE, ".runs", "instructions.json"), "w") as f:
        json.dump({"workload": args.workload, "warmup": args.warmup, "steps": args.steps,
                   "instructions_per_step": counts}, f, indent=1)


if __name__ == "__main__":
    main()
