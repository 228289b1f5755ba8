"""``xtrainer doctor``: is this machine ready to train, and how fast? A report to paste into an issue.

    xtrainer doctor [--full | --strategies xla_native:1,xla_ddp:2] [--devices N] [--output report.md]

It reports the runtime (versions, the device kind and chip, the XLA flags in the environment),
then trains a tiny model under the strategies of its plan, each at device counts it accepts (a
strategy whose ``multi_process`` is false runs on one device only; every other one on ``N``
devices: every local device on a TPU host, 2 on the CPU runtime). The default plan is quick: one
check for each way a strategy starts its replicas (its launcher's kind: in the calling process,
thread replicas, ``torch_xla.launch``, the SPMD process, torch's processes), on the first
strategy that starts them so, at its most devices, then at one device. ``--full`` checks every
strategy at its most devices, and each other way once. Each check tests that:

- the replicas agree (every replica's whole weights hash the same after training);
- nothing is recompiled after the first epoch (``XlaHealth``);
- a checkpoint round-trips (``load_from_checkpoint`` of the last checkpoint gives back the
  weights the fit returned, bit for bit);
- a resume continues (a second fit from ``ckpt_path="last"`` starts at the saved step and ends at
  the planned one);

and prints throughput, compile time and model FLOP/s (MFU where the chip's peak is known). Exit
code 0 when every check passed, 1 otherwise (the report then lists what failed and what to do).
Checks that start replicas run before those in the calling process: on a TPU host
``torch_xla.launch`` refuses a parent that has used the runtime.

This module imports nothing heavy at the top (``xtrainer --help`` stays fast).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import sys
import tempfile
import time
import traceback
from typing import Any

#: Environment variables that change what the runtime does, shown in the report when set.
FLAGS = ("PJRT_DEVICE", "CPU_NUM_DEVICES", "TPU_ACCELERATOR_TYPE", "TPU_VISIBLE_CHIPS", "XLA_FLAGS",
         "LIBTPU_INIT_ARGS", "XLA_USE_BF16", "XLA_DOWNCAST_BF16", "XLA_USE_SPMD", "XLA_PERSISTENT_CACHE_PATH",
         "XLA_THREAD_POOL_SIZE", "XLA_IR_DEBUG", "XLA_HLO_DEBUG", "PT_XLA_DEBUG_LEVEL", "NEURON_RT_NUM_CORES",
         "XTRAINER_CHIP")
EPOCHS, RESUME_EPOCHS, SAMPLES, BATCH = 2, 3, 128, 8


def add_command(commands: Any) -> None:
    """Register ``doctor`` among the ``xtrainer`` subcommands (``cli._parser``)."""
    doctor = commands.add_parser("doctor", help="check this machine: runtime, every strategy, checkpoints, speed",
                                 description=__doc__.split("\n\n")[0])
    doctor.add_argument("--strategies", default="",
                        help="comma-separated strategy[:devices] to try (default: one check per way of starting "
                             "replicas; see --full)")
    doctor.add_argument("--full", action="store_true",
                        help="check every strategy, at the most devices it accepts (a few minutes)")
    doctor.add_argument("--devices", type=int, default=None,
                        help="replicas for multi-device strategies (default: every local device; 2 on the CPU runtime)")
    doctor.add_argument("--output", default=None, help="also write the report to this file (Markdown)")
    doctor.set_defaults(run=run_command)


def run_command(args: argparse.Namespace) -> int:
    if args.full and args.strategies:
        raise SystemExit("xtrainer doctor: give --full or --strategies, not both.")
    report, ok = diagnose(args.strategies, args.devices, args.full)
    print(report, flush=True)
    if args.output:
        with open(args.output, "w") as f:
            f.write(report + "\n")
    return 0 if ok else 1


# --------------------------------------------------------------------------------------------
# The plan and the report (calling process).
# --------------------------------------------------------------------------------------------
def plan(strategies: str, devices: int | None, full: bool = False) -> list[tuple[str, int]]:
    """``(strategy, devices)`` pairs to try, those that run nothing in this process first.

    ``strategies`` as given (``name[:devices]``, a strategy that runs on one device at 1); else
    one check for each kind of launcher the strategies start their replicas with (each strategy at
    its most devices, then at one device, the first to use a kind checks it); ``full``: every
    strategy at its most devices, and each kind of launcher not yet seen once."""
    from xtrainer import _xla
    from xtrainer.strategies import STRATEGIES

    if devices is None:
        local = _xla.local_device_count_without_runtime() if _xla.requested_device_type() != "CPU" else 2
        devices = max(1, local or 1)
    if devices < 1:
        raise SystemExit(f"xtrainer doctor: --devices {devices}: give 1 or more.")
    most = {name: devices if _accepts_several(cls) else 1 for name, cls in STRATEGIES.items()}
    if strategies:
        pairs = []
        for item in strategies.split(","):
            name, _, count = item.strip().partition(":")
            if name not in STRATEGIES:
                raise SystemExit(f"xtrainer doctor: unknown strategy {name!r}; choose among {', '.join(STRATEGIES)}.")
            if count and not count.isdigit():
                raise SystemExit(f"xtrainer doctor: {item.strip()!r}: give strategy[:devices], "
                                 f"e.g. {name}:{most[name]}.")
            if count and int(count) > 1 and most[name] == 1:
                raise SystemExit(f"xtrainer doctor: strategy {name!r} runs on one device; ask for {name}:1.")
            pairs.append((name, int(count) if count else most[name]))
        pairs = list(dict.fromkeys(pairs))
    else:
        candidates = [(name, count) for name, cls in STRATEGIES.items() if cls.runs_standalone
                      for count in dict.fromkeys((most[name], 1))]
        pairs, kinds = [], set()
        for name, count in candidates:
            kind = type(_launcher(name, count))
            if kind not in kinds or (full and count == most[name]):
                pairs.append((name, count))
                kinds.add(kind)
    order = list(STRATEGIES)

    def last_in_this_process(pair: tuple[str, int]) -> tuple[bool, int]:
        in_caller = _launcher(*pair).runs_in_caller
        return in_caller, order.index(pair[0]) if in_caller else 0

    # Those in this process in the registry's order, the XLA strategies first: a backward on the
    # CPU here before the XLA runtime starts would keep XLA's backward from running.
    return sorted(pairs, key=last_in_this_process)  # stable: the others as planned


def _accepts_several(cls: type) -> bool:
    """Whether a strategy runs on several devices: its ``multi_process`` where it has one."""
    return bool(getattr(cls, "multi_process", True))


def _launcher(name: str, devices: int) -> Any:
    """The launcher ``name`` starts its replicas with on ``devices`` devices (nothing started)."""
    from xtrainer.strategies import STRATEGIES

    try:
        strategy = STRATEGIES[name]()
    except ValueError as err:  # a setting in the environment it refuses
        raise SystemExit(f"xtrainer doctor: strategy {name!r}: {err}") from None
    strategy.devices = devices
    return strategy.launcher


def version() -> str:
    """``xtrainer 0.1.0 (torch 2.9.0, torch_xla 2.9.0, Python 3.11.9)``: read from the installed
    packages' metadata, without importing torch."""
    from importlib import metadata

    from xtrainer import __version__

    def installed(name: str) -> str:
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            return f"{name} not installed"

    python = ".".join(str(n) for n in sys.version_info[:3])
    return f"xtrainer {__version__} ({installed('torch')}, {installed('torch_xla')}, Python {python})"


def diagnose(strategies: str = "", devices: int | None = None, full: bool = False) -> tuple[str, bool]:
    """The report and whether every check passed."""
    from xtrainer import _xla

    checks = plan(strategies, devices, full)
    scope = ("as asked (--strategies)" if strategies else "every strategy (--full)" if full
             else "quick: one per way of starting replicas (--full checks every strategy)")
    lines = ["## xtrainer doctor", "",
             f"- {version()}",
             f"- host: {platform.platform()}, {os.cpu_count()} CPUs",
             f"- runtime: PJRT device {_xla.requested_device_type()}"
             f" (PJRT_DEVICE {'set' if os.environ.get('PJRT_DEVICE') else 'unset: torch_xla chooses'}), "
             f"{_xla.local_device_count_without_runtime()} local device(s)",
             f"- chip: {_peak_text(_xla.chip_name())}",
             "- flags: " + (", ".join(f"{k}={os.environ[k]}" for k in FLAGS if k in os.environ) or "none set"),
             f"- checks, {scope}: " + ", ".join(f"{name} on {count}" for name, count in checks),
             ""]
    rows, failed, again, tracebacks = [], [], [], []
    for i, (name, count) in enumerate(checks, 1):
        print(f"xtrainer doctor: checking {name} on {count} device(s) ({i}/{len(checks)})", file=sys.stderr, flush=True)
        started = time.perf_counter()
        try:
            result = check_strategy(name, count)
        except Exception as err:  # noqa: BLE001 - one strategy's failure is a line of the report
            result = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
            tracebacks.append(f"### {name} on {count} device(s)\n\n```\n{traceback.format_exc()[-4000:]}```")
        result["wall"] = time.perf_counter() - started
        wrong = _what_failed(result)
        if wrong:
            failed.append(f"- {name} on {count} device(s): {'; '.join(wrong)}")
            again.append(f"{name}:{count}")
        rows.append(_row(name, count, result, not wrong))
    lines += ["| strategy | devices | result | replicas agree | no recompilation | checkpoint round trip | resume "
              "| steps/s | samples/s | compilations (s) | model FLOP/s | MFU | wall |",
              "| --- | ---: | --- | --- | --- | --- | --- | ---: | ---: | --- | ---: | ---: | ---: |", *rows, ""]
    if not failed:
        lines.append(f"All checks passed ({len(checks)} of {len(checks)}).")
    else:
        lines += [f"{len(failed)} of {len(checks)} checks FAILED:", *failed, "",
                  f"To do: rerun only these with `xtrainer doctor --strategies {','.join(again)}`; if the machine's "
                  "setup (the runtime, the flags above) is as intended, paste this report into an issue.",
                  *(["", *tracebacks] if tracebacks else [])]
    return "\n".join(lines), not failed


def _what_failed(r: dict[str, Any]) -> list[str]:
    """What went wrong in one check, with what to look at (empty: it passed)."""
    if "error" in r:
        return [f"{r['error']} (its traceback is below)"]
    return [text for key, text in (
        ("agree", "the replicas' weights differ after training (a collective or the data's sharding is wrong)"),
        ("steady", "graphs were recompiled after the first epoch (run with PT_XLA_DEBUG_LEVEL=2 to see why)"),
        ("round_trip", "the last checkpoint does not load back the trained weights"),
        ("resumed", f"the resumed fit did not continue where the first stopped ({r.get('resume_note')})"),
    ) if not r.get(key)]


def _peak_text(chip: str | None) -> str:
    from xtrainer import flops

    peak = flops.peak_flops(chip)
    if peak is None:
        return f"{chip or 'not detected'} (no peak FLOP/s known: MFU not reported; set XTRAINER_CHIP)"
    return f"{chip}, peak {peak / 1e12:.0f} TFLOP/s bf16"


def _row(name: str, count: int, r: dict[str, Any], passed: bool) -> str:
    if "error" in r:
        return f"| {name} | {count} | FAILED: {r['error']} | | | | | | | | | | {r['wall']:.0f} s |"
    yes = lambda v: "yes" if v else "**NO**"  # noqa: E731
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
    return (f"| {name} | {count} | {'ok' if passed else 'FAILED'} | {yes(r['agree'])} ({r['agree_note']}) "
            f"| {yes(r['steady'])} | {yes(r['round_trip'])} | {yes(r['resumed'])} ({r['resume_note']}) "
            f"| {r['steps_per_second']:.1f} | {r['samples_per_second']:.0f} | {r['compilations']:.0f} "
            f"({r['compile_seconds']:.1f}) | {r.get('model_flops_per_second', 0):.3g} | {mfu} | {r['wall']:.0f} s |")


# --------------------------------------------------------------------------------------------
# One strategy.
# --------------------------------------------------------------------------------------------
def check_strategy(name: str, devices: int) -> dict[str, Any]:
    """Train the tiny model for ``EPOCHS`` epochs, round-trip its last checkpoint, resume it to
    ``RESUME_EPOCHS``; the figures and the checks' results."""
    import torch

    from xtrainer import Trainer
    from xtrainer.callbacks import ModelCheckpoint, XlaHealth

    tiny, probe_class = __getattr__("_Tiny"), __getattr__("_Probe")
    with tempfile.TemporaryDirectory(prefix="xtrainer-doctor-") as root:
        def trainer(epochs: int, probe: Any) -> Trainer:
            return Trainer(strategy=name, devices=devices, max_epochs=epochs, log_every_n_steps=2,
                           default_root_dir=root, logger=False, enable_progress_bar=False,
                           enable_model_summary=False, num_sanity_val_steps=0, hang_timeout=None,
                           enable_goodput=False,
                           callbacks=[XlaHealth(on_recompile="warn", summary=False), probe,
                                      ModelCheckpoint(dirpath=os.path.join(root, "checkpoints"), save_last=True)])

        probe = probe_class()
        model = tiny()
        first = trainer(EPOCHS, probe)
        first.fit(model, _data())
        result = dict(probe.found)
        saved = first.checkpoint_callback.last_model_path or first.checkpoint_callback.best_model_path
        reloaded = tiny.load_from_checkpoint(saved)
        result["round_trip"] = all(torch.equal(a, b) for a, b in
                                   zip(model.state_dict().values(), reloaded.state_dict().values()))
        again = probe_class()
        second = trainer(RESUME_EPOCHS, again)
        second.fit(tiny(), _data(), ckpt_path="last")
        per_epoch = first.global_step // EPOCHS
        started_at = again.found.get("started_at_step")
        result["resumed"] = started_at == first.global_step and second.global_step == per_epoch * RESUME_EPOCHS
        result["resume_note"] = f"from step {started_at} to {second.global_step}"
        return result


def _data() -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 32, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, drop_last=True)


def _tiny_class() -> type:
    import torch
    from torch import nn

    from xtrainer import XModule

    class Tiny(XModule):
        """The doctor's model: an MLP classifier on 32 features, 4 classes."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

        def configure_model(self) -> None:
            """Under a strategy with a device mesh (``model_parallel``): the first two layers split
            over its tensor-parallel dimension, the MLP sharded over its data-parallel one."""
            mesh = self.device_mesh
            if mesh is None:
                return
            from torch.distributed.fsdp import fully_shard
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            parallelize_module(self.net, mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            fully_shard(self.net, mesh=mesh["data_parallel"])

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    Tiny.__module__, Tiny.__qualname__ = __name__, "_Tiny"
    return Tiny


def _probe_class() -> type:
    import torch

    from xtrainer import _xla
    from xtrainer.callbacks import Callback, XlaHealth

    class Probe(Callback):
        """Collects, in every replica, what the report needs; rank 0's comes back to the caller."""

        def __init__(self) -> None:
            self.found: dict[str, Any] = {}

        def on_fit_start(self, trainer: Any, module: Any) -> None:
            self.found["started_at_step"] = trainer.global_step

        def on_fit_end(self, trainer: Any, module: Any) -> None:
            health = next(cb for cb in trainer.callbacks if isinstance(cb, XlaHealth))
            keys = ("steps_per_second", "samples_per_second", "compilations", "compile_seconds",
                    "model_flops_per_second", "mfu")
            self.found.update({k: health.totals[k] for k in keys if k in health.totals})
            self.found["steady"] = not health.recompilations
            # A host sync and a rendezvous, once, after training: every replica's whole weights.
            weights = _xla.to_cpu(trainer.strategy.full_module_state_dict(trainer.model))
            digest = hashlib.sha256(b"".join(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                                             for t in weights.values())).hexdigest()
            digests = trainer.strategy.collectives.all_gather_object(digest)
            self.found["agree"] = len(set(digests)) == 1
            self.found["agree_note"] = (f"{len(digests)} replicas" if len(digests) > 1
                                        else "one program" if _xla.is_spmd() else "one replica")

        def state_dict(self) -> dict[str, Any]:
            return {"found": dict(self.found)}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.found = dict(state_dict.get("found", {}))

    Probe.__module__, Probe.__qualname__ = __name__, "_Probe"
    return Probe


def __getattr__(name: str) -> Any:
    """``_Tiny`` and ``_Probe`` are built on first use (they need torch), under names that pickle
    (replicas in another process unpickle them from this module)."""
    if name in ("_Tiny", "_Probe"):
        value = _tiny_class() if name == "_Tiny" else _probe_class()
        globals()[name] = value
        return value
    raise AttributeError(name)


if __name__ == "__main__":
    sys.exit(run_command(argparse.Namespace(strategies=",".join(sys.argv[1:]), devices=None, full=False, output=None)))
