"""Where xtrainer stands against a hand-written torch_xla loop, per strategy and workload.

    python benchmarks/run.py                       # both workloads, every contender, 3 repeats
    python benchmarks/run.py --quick               # fewer steps and repeats, to try it out
    python benchmarks/run.py --workloads lm --contenders xla_native xla_ddp --no-scaling

Workloads: ``mlp`` (the digits-sized MLP: framework overhead shows) and ``lm`` (a 4-layer decoder
transformer, width 256, sequence 128, on synthetic tokens: compute dominates). Contenders: the
hand-written loop (torch_xla's documented recipe: ``MpDeviceLoader``, ``xm.optimizer_step``), the
same loop in eager PyTorch on the CPU (a reference point), and the Trainer with ``xla_native``,
``xla_ddp``, ``xla_fsdp`` (ZeRO-3), ``xla_fsdp_zero2``, ``xla_spmd`` and ``xla_fsdpv2``. Then a
scaling run of the Trainer's strategies at 1, 2 and 4 replicas (SPMD: devices) on the CPU runtime.

Every measurement is a process of its own (``--one``), run interleaved with the others and
repeated, so that noise shows. Inside it, the steady-state rate and the CPU time per step are
measured between host reads after a warm-up (compilation excluded); the time to the first step
includes compiling. Ratios to the hand loop pair each run with the hand loop of the same repeat.
Writes ``benchmarks/RESULTS.md`` and ``benchmarks/results.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Callable

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from xtrainer import Trainer, XModule, _xla  # noqa: E402
from xtrainer.callbacks import Callback  # noqa: E402
from xtrainer.strategies import XlaFSDP  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CONTENDERS = ["hand", "eager", "xla_native", "xla_ddp", "xla_fsdp", "xla_fsdp_zero2", "xla_spmd", "xla_fsdpv2"]
SPMD = ("xla_spmd", "xla_fsdpv2")
SCALING = ["xla_native", "xla_ddp", "xla_fsdp", "xla_spmd", "xla_fsdpv2"]
WORKLOADS = {"mlp": {"batch": 64}, "lm": {"batch": 4, "seq": 128, "vocab": 1024, "width": 256, "layers": 4}}


# ---- the workloads ----------------------------------------------------------------------------
def make_net(workload: str) -> nn.Module:
    torch.manual_seed(0)
    if workload == "mlp":
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    return TinyLM(**{k: v for k, v in WORKLOADS["lm"].items() if k != "batch"})


class TinyLM(nn.Module):
    """A decoder-only transformer language model (pre-norm blocks, causal attention)."""

    def __init__(self, seq: int, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(seq, width) * 0.02)
        block = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position
        return self.head(self.blocks(h, mask=self.mask, is_causal=True))


def loss_of(workload: str, net: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    out = net(x)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def make_loader(workload: str, steps: int, samples_per_batch: int) -> DataLoader:
    """``steps`` batches of ``samples_per_batch`` samples."""
    g = torch.Generator().manual_seed(0)
    n = steps * samples_per_batch
    if workload == "mlp":
        x = torch.randn(n, 64, generator=g)
        y = torch.randint(0, 10, (n,), generator=g)
    else:
        cfg = WORKLOADS["lm"]
        tokens = torch.randint(0, cfg["vocab"], (n, cfg["seq"] + 1), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
    return DataLoader(TensorDataset(x, y), batch_size=samples_per_batch, shuffle=False, drop_last=True)


class Model(XModule):
    def __init__(self, workload: str) -> None:
        super().__init__()
        self.workload = workload
        self.net = make_net(workload)

    def training_step(self, batch, batch_idx):
        loss = loss_of(self.workload, self.net, batch)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


# ---- one measurement ----------------------------------------------------------------------------
class Probe(Callback):
    """Times the steady state between host reads (every ``log_every_n_steps``) on rank 0 and
    counts compilations and transfers over it."""

    def __init__(self, warmup: int, started: float) -> None:
        self.warmup, self.started = warmup, started
        self.marks: list[tuple[int, float]] = []
        self.first_step = None
        self.counts: dict[str, int] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step == 1:
            _xla.wait_device_ops()  # host sync: the first step's end, compile included
            self.first_step = time.time() - self.started
        if step >= self.warmup and step % trainer.log_every_n_steps == 0:  # the Trainer just read values
            if not self.marks:
                self.counts = {"compiles": _xla.compile_count(), "transfers": _xla.transfer_from_device_count()}
            self.marks.append((step, time.perf_counter(), time.process_time()))
            self.counts_end = {"compiles": _xla.compile_count(), "transfers": _xla.transfer_from_device_count()}

    def state_dict(self):
        end = getattr(self, "counts_end", self.counts)
        return {"marks": self.marks, "first_step": self.first_step,
                "compiles": end.get("compiles", 0) - self.counts.get("compiles", 0),
                "transfers": end.get("transfers", 0) - self.counts.get("transfers", 0)}

    def load_state_dict(self, state):
        self.result = state


def measure(workload: str, contender: str, steps: int, warmup: int, devices: int, every: int) -> dict:
    batch = WORKLOADS[workload]["batch"]
    if contender in SPMD:  # one program: the loader yields the global batch, split over the devices
        loader = make_loader(workload, steps, batch * devices)
    else:  # one loader per replica, each yielding `batch`
        loader = make_loader(workload, steps * devices, batch)
    started = time.time()
    if contender in ("hand", "eager"):
        return hand_loop(workload, loader, warmup, every, started, xla=contender == "hand")
    strategy = XlaFSDP(reshard_after_forward=False) if contender == "xla_fsdp_zero2" else contender
    probe = Probe(warmup, started)
    trainer = Trainer(strategy=strategy, devices=devices, max_epochs=1, log_every_n_steps=every, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_xla_health=False,
                      default_root_dir=os.path.join(HERE, ".runs"), callbacks=[probe])
    trainer.fit(Model(workload), loader)
    # A fit that ran in other processes hands rank 0's callback state back through load_state_dict.
    state = probe.result if hasattr(probe, "result") else probe.state_dict()
    return summarize(state, batch * devices)


def hand_loop(workload: str, loader: DataLoader, warmup: int, every: int, started: float, xla: bool) -> dict:
    """torch_xla's documented loop (``xla``), or the same loop in eager PyTorch on the CPU."""
    device = _xla.device() if xla else torch.device("cpu")
    net = make_net(workload).to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    marks, first, counts = [], None, {"compiles": 0, "transfers": 0}
    if xla:  # the documented torch_xla loader, as a hand-written loop uses it
        from torch_xla.distributed.parallel_loader import MpDeviceLoader

        batches = MpDeviceLoader(loader, device)
    else:
        batches = loader
    for step, batch in enumerate(batches, start=1):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(workload, net, batch)
        loss.backward()
        if xla:
            _xla.optimizer_step(opt)
        else:
            opt.step()
        if step == 1:
            if xla:
                _xla.sync()  # the loader cuts the graph only when the next batch is taken
                _xla.wait_device_ops()  # host sync: the first step's end, compile included
            first = time.time() - started
        if step >= warmup and step % every == 0:
            if xla:
                _xla.sync()
            loss.item()  # host sync: read the loss, as a training loop logs it
            if not marks and xla:
                counts = {"compiles": _xla.compile_count(), "transfers": _xla.transfer_from_device_count()}
            marks.append((step, time.perf_counter(), time.process_time()))
    ends = {"compiles": _xla.compile_count(), "transfers": _xla.transfer_from_device_count()} if xla else counts
    state = {"marks": marks, "first_step": first, "compiles": ends["compiles"] - counts["compiles"],
             "transfers": ends["transfers"] - counts["transfers"]}
    return summarize(state, loader.batch_size)


def summarize(state: dict, samples_per_step: int) -> dict:
    (s0, t0, c0), (s1, t1, c1) = state["marks"][0], state["marks"][-1]
    steps = s1 - s0
    rate = steps / (t1 - t0)
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    return {"steps_per_s": rate, "samples_per_s": rate * samples_per_step,
            "cpu_ms_per_step": 1000 * (c1 - c0) / steps,  # every thread of the process that ran the steps
            "first_step_s": state["first_step"], "compiles": state["compiles"],
            "transfers_per_step": state["transfers"] / max(steps, 1), "peak_mb": peak / 1024}


# ---- the driver ----------------------------------------------------------------------------------
def run_one(workload: str, contender: str, args: argparse.Namespace, devices: int = 1) -> dict | None:
    steps, warmup = (args.steps[workload], args.warmup)
    cmd = [sys.executable, __file__, "--one", workload, contender, str(steps), str(warmup), str(devices), str(args.every)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        print(f"  {workload}/{contender}/x{devices} failed:\n{done.stderr[-1500:]}", flush=True)
        return None
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 repeat, fewer steps")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--contenders", nargs="+", default=CONTENDERS, choices=CONTENDERS)
    parser.add_argument("--no-scaling", action="store_true")
    parser.add_argument("--one", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        workload, contender, steps, warmup, devices, every = args.one
        print(json.dumps(measure(workload, contender, int(steps), int(warmup), int(devices), int(every))), flush=True)
        return
    args.steps = {"mlp": 300, "lm": 40} if not args.quick else {"mlp": 120, "lm": 25}
    args.warmup, args.every = 10, 10
    args.repeats = 1 if args.quick else args.repeats
    contenders = ["hand"] + [c for c in args.contenders if c != "hand"]  # the ratios' reference comes first
    results: Results = {}
    for r in range(args.repeats):
        for workload in args.workloads:
            for contender in contenders:  # interleaved: every contender once per repeat
                record(results, (workload, contender, 1), r, run_one(workload, contender, args))
        if not args.no_scaling:
            for devices in (2, 4):
                for contender in SCALING:
                    record(results, ("mlp", contender, devices), r, run_one("mlp", contender, args, devices))
    write_results(results, args, contenders)


#: (workload, contender, devices) -> {repeat: measurement}
Results = dict[tuple[str, str, int], dict[int, dict]]


def record(results: Results, key: tuple[str, str, int], repeat: int, out: dict | None) -> None:
    if out is None:
        return
    results.setdefault(key, {})[repeat] = out
    workload, contender, devices = key
    print(f"repeat {repeat} {workload:<4} x{devices} {contender:<15} {out['steps_per_s']:8.2f} steps/s "
          f"{out['cpu_ms_per_step']:9.1f} CPU ms/step", flush=True)


def median(runs: dict[int, dict], key: str) -> float:
    return statistics.median(r[key] for r in runs.values())


def paired(runs: dict[int, dict], base: dict[int, dict], ratio: Callable[[dict, dict], float]) -> str:
    """Median and range of the ratio to the reference measured in the same repeat (next to it in
    time), so that the machine's drift between repeats cancels."""
    values = sorted(ratio(runs[r], base[r]) for r in runs if r in base)
    if not values:
        return "n/a"
    spread = f" ({values[0]:.2f}-{values[-1]:.2f})" if len(values) > 1 else ""
    return f"{statistics.median(values):.3f}{spread}"


def wall_ratio(run: dict, base: dict) -> float:
    return run["steps_per_s"] / base["steps_per_s"]


def cpu_ratio(run: dict, base: dict) -> float:
    return base["cpu_ms_per_step"] / run["cpu_ms_per_step"]


def write_results(results: Results, args: argparse.Namespace, contenders: list[str]) -> None:
    lines = ["# Benchmark results", "",
             f"{datetime.date.today()}; {platform.machine()} with {os.cpu_count()} cores, Python "
             f"{platform.python_version()}, torch {torch.__version__}, torch_xla {_xla.TORCH_XLA_VERSION}, "
             f"XLA CPU runtime; {args.repeats} repeat(s), medians (ranges in brackets); `python benchmarks/run.py`.",
             "",
             "*vs hand loop* compares each contender with the hand loop of the same repeat. *Wall* is steps/s; "
             "*CPU* is the hand loop's CPU time per step over the contender's (all threads of the process: the "
             "host's tracing and the CPU runtime's execution). On a shared virtual machine the wall clock drifts "
             "with other tenants' load; CPU time does not, so it is the steadier of the two.", ""]
    for workload in args.workloads:
        base = results.get((workload, "hand", 1), {})
        lines += [f"## {workload}: {args.steps[workload]} steps, batch {WORKLOADS[workload]['batch']}", "",
                  "| contender | steps/s | samples/s | vs hand loop (wall) | vs hand loop (CPU) | CPU ms/step "
                  "| first step (s) | compilations after warm-up | host reads per step | peak host memory (MB) |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for contender in contenders:
            runs = results.get((workload, contender, 1))
            if not runs:
                continue
            compiles, reads = (f"{median(runs, 'compiles'):.0f}", f"{median(runs, 'transfers_per_step'):.2f}") \
                if contender != "eager" else ("-", "-")  # eager PyTorch compiles nothing and has no device
            lines.append(
                f"| {contender} | {median(runs, 'steps_per_s'):.2f} | {median(runs, 'samples_per_s'):.0f} "
                f"| {paired(runs, base, wall_ratio)} | {paired(runs, base, cpu_ratio)} "
                f"| {median(runs, 'cpu_ms_per_step'):.1f} | {median(runs, 'first_step_s'):.1f} "
                f"| {compiles} | {reads} | {median(runs, 'peak_mb'):.0f} |")
        lines.append("")
    if any(key[2] > 1 for key in results):
        lines += ["## Scaling on the CPU runtime (mlp, samples/s over all replicas or devices)", "",
                  "| strategy | 1 | 2 | 4 | efficiency at 4 |", "| --- | ---: | ---: | ---: | ---: |"]
        for contender in SCALING:
            rates = [median(results[("mlp", contender, d)], "samples_per_s") if ("mlp", contender, d) in results
                     else float("nan") for d in (1, 2, 4)]
            lines.append(f"| {contender} | {rates[0]:.0f} | {rates[1]:.0f} | {rates[2]:.0f} "
                         f"| {rates[2] / (4 * rates[0]):.2f} |")
        lines += ["", "Each replica or virtual device keeps a batch of "
                  f"{WORKLOADS['mlp']['batch']} (SPMD: the global batch grows with the devices). The replicas of the "
                  "CPU runtime are threads sharing this machine's cores, and every graph cut waits for its replica's "
                  "execution (see `xtrainer/strategies/cpu_replicas.py`); SPMD's virtual devices share them too. "
                  "These numbers show what multi-device runs cost on a laptop, not how a TPU pod scales.", ""]
    findings = os.path.join(HERE, "FINDINGS.md")  # what was learnt from the numbers, kept across runs
    if os.path.exists(findings):
        with open(findings) as f:
            lines += ["", f.read()]
    with open(os.path.join(HERE, "RESULTS.md"), "w") as f:
        f.write("\n".join(lines))
    plot(results, args, contenders)
    print("\n".join(lines))


def plot(results: Results, args: argparse.Namespace, contenders: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(args.workloads), figsize=(6 * len(args.workloads), 3.8), squeeze=False)
    for ax, workload in zip(axes[0], args.workloads):
        base = results.get((workload, "hand", 1))
        if not base:
            continue
        names = [c for c in contenders if (workload, c, 1) in results]
        for offset, (label, ratio) in zip((-0.2, 0.2), (("wall", wall_ratio), ("CPU time", cpu_ratio))):
            values = [statistics.median(ratio(run, base[r]) for r, run in results[(workload, c, 1)].items()
                                        if r in base) for c in names]
            ax.bar([i + offset for i in range(len(names))], values, width=0.4, label=label)
        ax.set_xticks(range(len(names)), names, rotation=30)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"{workload}: relative to the hand loop (higher is faster)")
        ax.legend()
    figure.tight_layout()
    figure.savefig(os.path.join(HERE, "results.png"), dpi=100)


if __name__ == "__main__":
    main()
