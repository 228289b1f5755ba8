"""Where xtrainer's step costs more (or less) than the hand-written torch_xla loop.

    python benchmarks/profile_overhead.py                          # hf_llama, every variant, 3 repeats
    python benchmarks/profile_overhead.py --workload mlp --steps 200 --repeats 5
    python benchmarks/profile_overhead.py --cprofile               # the host's Python, function by function

Variants, each a process of its own, interleaved and repeated as in ``run.py`` (CPU time per step
between the host reads after warm-up, paired with the hand loop of the same repeat):

- ``hand``: ``run.py``'s hand loop (``MpDeviceLoader``, ``xm.optimizer_step``, a loss read per interval);
- ``hand_device_batches``: the same loop fed by xtrainer's loader (``_xla.DeviceBatches``, one
  graph cut per step by ``torch_xla.sync()``): what the loader costs;
- ``trainer``: ``Trainer(strategy="xla_native")``, as ``run.py`` runs it;
- ``trainer_no_watch``: ``detect_nonfinite="off"`` (no non-finite-loss watch in the step's graph);
- ``trainer_no_log``: a ``training_step`` that does not call ``self.log`` (no on-device accumulators);
- ``trainer_bare``: both, and no callback but the probe: what is left is the loop and its hooks.

``--cprofile`` runs the hand loop and the Trainer in this process under ``cProfile`` and prints,
per step, the host time of the functions that differ: xtrainer's own (``xtrainer/``), the loaders'
and the optimizer step's.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import run  # noqa: E402  (benchmarks/run.py: the workloads, the probe, the hand loop)
import torch  # noqa: E402

from xtrainer import Trainer, _xla  # noqa: E402

VARIANTS = ["hand", "hand_device_batches", "trainer", "trainer_no_watch", "trainer_no_log", "trainer_bare"]


class Quiet(run.Model):
    """``run.Model`` without ``self.log``."""

    def training_step(self, batch, batch_idx):
        return run.loss_of(self.workload, self.net, batch)


def hand_device_batches(workload: str, loader, warmup: int, every: int, started: float) -> dict:
    """``run.hand_loop`` with xtrainer's loader in place of ``MpDeviceLoader``."""
    device = _xla.device()
    net = run.make_net(workload).to(device)
    opt = run.make_optimizer(net.parameters())
    marks = run.Marks(warmup, every, started)
    for step, batch in enumerate(_xla.DeviceBatches(loader, device), start=1):
        opt.zero_grad(set_to_none=True)
        loss = run.loss_of(workload, net, batch)
        loss.backward()
        _xla.optimizer_step(opt)
        _xla.sync()  # DeviceBatches leaves the graph cut to the loop, as the Trainer's strategy does
        if step == 1:
            marks.first_step()
        if marks.due(step):
            loss.item()
            marks.mark(step)
    return run.summarize(marks.state(False), loader.batch_size)


def measure(workload: str, variant: str, steps: int, warmup: int, every: int) -> dict:
    loader = run.make_loader(workload, steps, run.WORKLOADS[workload]["batch"])
    started = time.time()
    if variant == "hand":
        return run.hand_loop(workload, loader, warmup, every, started, xla=True)
    if variant == "hand_device_batches":
        return hand_device_batches(workload, loader, warmup, every, started)
    probe = run.Probe(warmup, started)
    bare = variant == "trainer_bare"
    trainer = Trainer(strategy="xla_native", max_epochs=1, log_every_n_steps=every, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_xla_health=False,
                      enable_model_summary=False, default_root_dir=os.path.join(HERE, ".runs"), callbacks=[probe],
                      detect_nonfinite="off" if variant in ("trainer_no_watch", "trainer_bare") else "raise")
    model = (Quiet if variant in ("trainer_no_log", "trainer_bare") else run.Model)(workload)
    if bare:
        trainer.callbacks = [cb for cb in trainer.callbacks if cb is probe]
    trainer.fit(model, loader)
    return run.summarize(probe.state_dict(), loader.batch_size)


def cprofile(workload: str, steps: int, warmup: int, every: int) -> None:
    """Both loops under cProfile in this process (the Trainer second: its compilations are cached by
    then, which does not matter for the per-step host time of the functions listed)."""
    loader = run.make_loader(workload, steps, run.WORKLOADS[workload]["batch"])
    for name, fn in (("hand", lambda: run.hand_loop(workload, loader, warmup, every, time.time(), xla=True)),
                     ("trainer", lambda: measure(workload, "trainer", steps, warmup, every))):
        profile = cProfile.Profile()
        profile.enable()
        fn()
        profile.disable()
        stats = pstats.Stats(profile)
        total = sum(row[2] for row in stats.stats.values())  # own time of every function
        print(f"\n== {name}: {1000 * total / steps:.1f} ms of profiled host time per step "
              f"(all {steps} steps, compilation included)")
        rows = []
        for (path, line, func), (_, calls, own, cumulative, _) in stats.stats.items():
            interesting = ("xtrainer" in path or "parallel_loader" in path or func in ("optimizer_step", "sync")
                           or "adamw" in path or "optimizer.py" in path)
            if interesting and cumulative / steps > 1e-4:
                rows.append((cumulative, own, calls, f"{os.path.relpath(path) if 'xtrainer' in path else os.path.basename(path)}:{line}({func})"))
        for cumulative, own, calls, where in sorted(rows, reverse=True)[:30]:
            print(f"  {1000 * cumulative / steps:8.2f} ms/step cumulative {1000 * own / steps:7.2f} own "
                  f"{calls / steps:6.1f} calls/step  {where}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="hf_llama", choices=list(run.WORKLOADS))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.workload, args.one, args.steps, args.warmup, args.every)), flush=True)
        return
    if args.cprofile:
        cprofile(args.workload, args.steps, args.warmup, args.every)
        return
    runs: dict[str, dict[int, dict]] = {}
    variants = ["hand"] + [v for v in args.variants if v != "hand"]
    for repeat in range(args.repeats):
        for variant in variants:
            cmd = [sys.executable, __file__, "--one", variant, "--workload", args.workload, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--every", str(args.every)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode or not lines:
                print(f"{variant} failed:\n{done.stderr[-1500:]}", flush=True)
                continue
            out = runs.setdefault(variant, {})[repeat] = json.loads(lines[-1])
            print(f"repeat {repeat} {variant:<20} {out['cpu_ms_per_step']:8.1f} CPU ms/step "
                  f"{out['steps_per_s']:6.2f} steps/s {out['transfers_per_step']:.2f} reads/step "
                  f"{out['compiles']} compilations", flush=True)
    hand = runs.get("hand", {})
    print(f"\n{args.workload}, {args.steps} steps, {args.repeats} repeats: CPU time per step, and the hand loop's "
          "over the variant's in the same repeat (median, range; above 1: the variant costs less)")
    for variant in variants:
        if variant not in runs:
            continue
        values = sorted(hand[r]["cpu_ms_per_step"] / out["cpu_ms_per_step"] for r, out in runs[variant].items()
                        if r in hand)
        cpu = statistics.median(out["cpu_ms_per_step"] for out in runs[variant].values())
        print(f"  {variant:<20} {cpu:8.1f} ms   {statistics.median(values):.3f} ({values[0]:.3f}-{values[-1]:.3f})")


if __name__ == "__main__":
    main()
