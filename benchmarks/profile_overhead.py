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
import contextlib
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


def cprofile(workload: str, steps: int, warmup: int, every: int, order: list[str]) -> None:
    """Both loops in this process, each under cProfile from its first host read after the warm-up
    to its last (the steady state ``run.py`` times: no compilation in it): the host time of the
    functions that differ, per step."""
    loader = run.make_loader(workload, steps, run.WORKLOADS[workload]["batch"])
    loops = {"hand": lambda: run.hand_loop(workload, loader, warmup, every, time.time(), xla=True),
             "trainer": lambda: measure(workload, "trainer", steps, warmup, every)}
    for name in order:
        fn = loops[name]
        profile = cProfile.Profile()
        with profiled_between_marks(profile, steps):
            fn()
        stats = pstats.Stats(profile)
        timed = steps - warmup
        total = sum(row[2] for row in stats.stats.values())  # own time of every function
        print(f"\n== {name}: {1000 * total / timed:.1f} ms of host time per step under the profiler "
              f"(steps {warmup}-{steps})")
        groups: dict[str, float] = {}
        for (path, line, func), (_, calls, own, cumulative, _) in stats.stats.items():
            groups[category(path, func)] = groups.get(category(path, func), 0.0) + own
        print("  own host time by where it is spent, ms/step: " + ", ".join(
            f"{name} {1000 * value / timed:.2f}" for name, value in sorted(groups.items(), key=lambda kv: -kv[1])))
        rows = []
        for (path, line, func), (_, calls, own, cumulative, _) in stats.stats.items():
            if cumulative / timed > 2e-5:
                where = os.path.relpath(path) if "xtrainer" in path else os.path.basename(path)
                rows.append((cumulative, own, calls, f"{where}:{line}({func})"))
        for cumulative, own, calls, where in sorted(rows, reverse=True)[:45]:
            print(f"  {1000 * cumulative / timed:8.2f} ms/step cumulative {1000 * own / timed:7.2f} own "
                  f"{calls / timed:6.1f} calls/step  {where}")


def category(path: str, func: str) -> str:
    """Where a profiled function belongs, for the per-step summary."""
    if "_xla_step_marker" in func:
        return "graph cut (torch_xla.sync: trace, hash, launch, wait)"
    if "run_backward" in func:
        return "autograd (backward trace)"
    if f"{os.sep}xtrainer{os.sep}" in path:
        return "xtrainer's own Python"
    if "parallel_loader" in path or "queue" in path or "threading" in path or "dataloader" in path:
        return "loaders and their threads"
    if f"{os.sep}optim{os.sep}" in path or "_meta_registrations" in path or "_prims" in path or "_refs" in path:
        return "optimizer (incl. its meta functions)"
    if "transformers" in path:
        return "model (transformers)"
    return "other (torch ops, tensors, benchmark)"


@contextlib.contextmanager
def profiled_between_marks(profile: cProfile.Profile, steps: int):
    """``profile`` on from the first steady-state mark (``run.Marks.mark``, ``run.Probe``) to the
    last (at step ``steps``)."""
    on = [False]

    def marked(step: int) -> None:
        if step >= steps:
            profile.disable()
        elif not on[0]:
            on[0] = True
            profile.enable()

    mark, probe_end = run.Marks.mark, run.Probe.on_train_batch_end

    def hand_mark(self, step):
        mark(self, step)
        marked(step)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        before = len(self.marks)
        probe_end(self, trainer, module, outputs, batch, batch_idx)
        if len(self.marks) > before:
            marked(trainer.global_step)

    run.Marks.mark, run.Probe.on_train_batch_end = hand_mark, on_train_batch_end
    try:
        yield
    finally:
        profile.disable()
        run.Marks.mark, run.Probe.on_train_batch_end = mark, probe_end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="hf_llama", choices=list(run.WORKLOADS))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--order", nargs=2, default=["hand", "trainer"], choices=["hand", "trainer"],
                        help="--cprofile: which loop runs first in the process")
    parser.add_argument("--clock", choices=("process", "thread"), default="process",
                        help="CPU time of the whole process (run.py's measure: tracing and the CPU runtime's "
                             "execution), or of the main thread only (the host's tracing and the loop: what "
                             "a framework adds, less disturbed by other tenants)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.clock == "thread":  # run.py's marks read time.process_time(); the main thread takes them all
        time.process_time = time.thread_time
    if args.one:
        print(json.dumps(measure(args.workload, args.one, args.steps, args.warmup, args.every)), flush=True)
        return
    if args.cprofile:
        cprofile(args.workload, args.steps, args.warmup, args.every, args.order)
        return
    runs: dict[str, dict[int, dict]] = {}
    variants = ["hand"] + [v for v in args.variants if v != "hand"]
    for repeat in range(args.repeats):
        for variant in variants:
            cmd = [sys.executable, __file__, "--one", variant, "--workload", args.workload, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--every", str(args.every), "--clock", args.clock]
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
    print(f"\n{args.workload}, {args.steps} steps, {args.repeats} repeats: CPU time per step ({args.clock}), and the hand loop's "
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
