"""``xtrainer doctor``: is this machine ready to train, and how fast? A report to paste into an issue.

    xtrainer doctor [--strategies xla_native:1,xla_ddp:2] [--devices N] [--output report.md]

It reports the runtime (versions, the device kind and chip, the XLA flags in the environment),
then trains a tiny model under every strategy that applies (``xla_native`` on one device, and
every strategy on ``N`` devices: every local device on a TPU host, 2 on the CPU runtime), and for
each checks that:

- the replicas agree (every replica's whole weights hash the same after training);
- nothing is recompiled after the first epoch (``XlaHealth``);
- a checkpoint round-trips (``load_from_checkpoint`` of the last checkpoint gives back the
  weights the fit returned, bit for bit);
- a resume continues (a second fit from ``ckpt_path="last"`` starts at the saved step and ends at
  the planned one);

and prints throughput, compile time and model FLOP/s (MFU where the chip's peak is known). Exit
code 0 when every check passed, 1 otherwise. Strategies that start replicas run before the
one-device check: on a TPU host ``torch_xla.launch`` refuses a parent that has used the runtime.

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
                        help="comma-separated strategy[:devices] to try (default: every strategy that applies)")
    doctor.add_argument("--devices", type=int, default=None,
                        help="replicas for multi-device strategies (default: every local device; 2 on the CPU runtime)")
    doctor.add_argument("--output", default=None, help="also write the report to this file (Markdown)")
    doctor.set_defaults(run=run_command)


def run_command(args: argparse.Namespace) -> int:
    report, ok = diagnose(args.strategies, args.devices)
    print(report, flush=True)
    if args.output:
        with open(args.output, "w") as f:
            f.write(report + "\n")
    return 0 if ok else 1


# --------------------------------------------------------------------------------------------
# The plan and the report (calling process).
# --------------------------------------------------------------------------------------------
def plan(strategies: str, devices: int | None) -> list[tuple[str, int]]:
    """``(strategy, devices)`` pairs to try, replicas-starting ones first."""
    from xtrainer import _xla
    from xtrainer.strategies import STRATEGIES

    if devices is None:
        local = _xla.local_device_count_without_runtime() if _xla.requested_device_type() != "CPU" else 2
        devices = max(1, local or 1)
    if strategies:
        pairs = []
        for item in strategies.split(","):
            name, _, count = item.strip().partition(":")
            if name not in STRATEGIES:
                raise SystemExit(f"xtrainer doctor: unknown strategy {name!r}; choose among {', '.join(STRATEGIES)}.")
            pairs.append((name, int(count) if count else devices))
    else:
        pairs = [(name, devices) for name in STRATEGIES if devices > 1 or name in ("xla_spmd",)]
        pairs.append(("xla_native", 1))
    return sorted(dict.fromkeys(pairs), key=lambda p: p[1] == 1)  # stable: one-device checks last


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


def diagnose(strategies: str = "", devices: int | None = None) -> tuple[str, bool]:
    """The report and whether every check passed."""
    from xtrainer import _xla

    lines = ["## xtrainer doctor", "",
             f"- {version()}",
             f"- host: {platform.platform()}, {os.cpu_count()} CPUs",
             f"- runtime: PJRT device {_xla.requested_device_type()}"
             f" (PJRT_DEVICE {'set' if os.environ.get('PJRT_DEVICE') else 'unset: torch_xla chooses'}), "
             f"{_xla.local_device_count_without_runtime()} local device(s)",
             f"- chip: {_peak_text(_xla.chip_name())}",
             "- flags: " + (", ".join(f"{k}={os.environ[k]}" for k in FLAGS if k in os.environ) or "none set"),
             ""]
    rows, ok, failures = [], True, []
    for name, count in plan(strategies, devices):
        started = time.perf_counter()
        try:
            result = check_strategy(name, count)
        except Exception as err:  # noqa: BLE001 - one strategy's failure is a line of the report
            result = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
            failures.append(f"### {name} on {count} device(s)\n\n```\n{traceback.format_exc()[-4000:]}```")
        result["wall"] = time.perf_counter() - started
        passed = "error" not in result and all(result[k] for k in ("agree", "steady", "round_trip", "resumed"))
        ok &= passed
        rows.append(_row(name, count, result, passed))
    lines += ["| strategy | devices | result | replicas agree | no recompilation | checkpoint round trip | resume "
              "| steps/s | samples/s | compilations (s) | model FLOP/s | MFU | wall |",
              "| --- | ---: | --- | --- | --- | --- | --- | ---: | ---: | --- | ---: | ---: | ---: |", *rows]
    if failures:
        lines += ["", *failures]
    lines += ["", "All checks passed." if ok else "Some checks FAILED (above)."]
    return "\n".join(lines), ok


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
    sys.exit(run_command(argparse.Namespace(strategies=",".join(sys.argv[1:]), devices=None, output=None)))
