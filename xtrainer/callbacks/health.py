"""``XlaHealth``: compilations, executions, transfers and memory, and recompilations named."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from xtrainer import compile_cache, flops
from xtrainer._lazy_xla import xla as _xla
from xtrainer.callbacks.base import Callback
from xtrainer.loop.results import batch_size
from xtrainer.strategies import shared_process
from xtrainer.trainer_view import TrainerView

if TYPE_CHECKING:
    from xtrainer.module import XModule


class RecompilationError(RuntimeError):
    """A graph was compiled after the first epoch (``XlaHealth(on_recompile="raise")``)."""


class XlaHealth(Callback):
    """Watches what makes XLA training slow without saying so. Added by the Trainer by default.

    Every ``log_every_n_steps`` it logs, under ``xla/``: compilations and compile seconds,
    graph executions and device-to-host transfers in the interval, and the device's memory where
    the runtime reports it (not on the CPU runtime); under ``throughput/``: optimizer steps and
    samples (over all replicas) per second. It reads torch_xla's counters on the host, never a
    device value, so it adds no host sync.

    After the first training epoch, its validation and the first step after them (which, under
    FSDP, compiles a graph of its own: parameters come out of evaluation in another state), every
    graph should be compiled. A new compilation after that is a recompilation: it is reported once per new compilation, with the
    step and what xtrainer can see differ (the batch's shapes against those of the first epoch);
    ``PT_XLA_DEBUG_LEVEL=2`` makes torch_xla print its own analysis. Graphs compiled while a
    checkpoint is written (should a save compute on the device) are counted in
    ``xla/compilations`` but are not recompilations. ``on_recompile="raise"``
    turns the report into an error (for CI). ``fit`` ends with a summary line.

    Model FLOPs (``xtrainer/flops.py``: counted once at the first batch on the ``meta`` device, or
    the module's ``flops_per_step``) give ``throughput/model_flops_per_second`` and, where the
    chip's peak is known, ``throughput/mfu`` (also on the progress line: ``mfu``, else
    ``flop/s``); tokens (``input_ids``, or ``tokens_per_step``) give
    ``throughput/tokens_per_second``. The summary adds a line for them and one for the persistent
    compilation cache (``xtrainer/compile_cache.py``): graphs loaded from it, and plainly when it
    did not hit.

    Under the native strategies the compiler is ``torch.compile`` (their ``compile=True``): its
    counters (``Strategy.device_counters``, read where XLA's are) give ``torch_compile/compilations``,
    ``torch_compile/compile_seconds`` and ``torch_compile/graph_breaks``, the same recompilation
    warnings (``TORCH_LOGS=recompiles`` shows Dynamo's reasons) and the summary line; PyTorch
    counts no executions or transfers, so none are shown.

    torch_xla's counters belong to the process. Where one process runs several replicas (threads,
    on the CPU runtime with ``devices=N``) they add up every replica's work, so this callback
    divides them by the replicas the process runs: the logged ``xla/`` figures and the summary
    are per replica (the summary says so), comparable with a single-replica run. Throughput is
    over all replicas.

    Args:
        on_recompile: ``"warn"`` (default), ``"raise"`` or ``"ignore"``.
        summary: print the summary at the end of ``fit`` (rank 0).
    """

    def __init__(self, on_recompile: str = "warn", summary: bool = True) -> None:
        if on_recompile not in ("warn", "raise", "ignore"):
            raise ValueError(f"XlaHealth(on_recompile={on_recompile!r}): use 'warn', 'raise' or 'ignore'.")
        self.on_recompile, self.summary = on_recompile, summary
        self.recompilations: list[dict[str, Any]] = []
        self._warm = self._warming_last_step = False
        self._first_epoch_shapes: set[tuple] = set()
        self._cache_counts: dict[str, int] = {}
        self._data_compiles_seen, self._data_warned = 0, False
        self._compiles_seen = 0  # graphs compiled by the steps at the last check (a fit starts it afresh)
        self._compiling = True

    def setup(self, trainer: "TrainerView", module: "XModule", stage: str) -> None:
        # From the replica's start: restoring a checkpoint compiles too (cache lookups included).
        self._cache_counts = _cache_counts(trainer)

    def on_fit_start(self, trainer: "TrainerView", module: "XModule") -> None:
        self.recompilations, self._warm, self._first_epoch_shapes = [], False, set()
        self._warming_last_step = False
        self._fit = self._mark(trainer)
        self._interval = self._fit
        self._samples = self._interval_samples = 0
        self._work = _Work(trainer)
        self._replicas = replicas_in_process(trainer)
        # Whether anything compiles in this run (not so on an eager device without torch.compile):
        # else the per-batch watch of recompilations has nothing to watch, and does nothing.
        self._compiling = trainer.strategy.runtime.counts_compilations
        self._compiles_seen = self._fit["compiles"] - trainer.checkpoint_compilations - self._fit["data_compiles"]
        self._data_compiles_seen = self._fit["data_compiles"]
        self._data_warned = False

    def _mark(self, trainer: "TrainerView") -> dict[str, float]:
        return {"time": time.perf_counter(), "step": trainer.global_step, **trainer.strategy.runtime.device_counters(),
                **_data_counters(trainer)}

    def _step_compiles(self, trainer: "TrainerView") -> tuple[int, int]:
        """Graphs compiled by the steps (a checkpoint's and the data loading's left out), and by
        the data loading, in this process so far."""
        data = _data_counters(trainer)["data_compiles"]
        return trainer.strategy.runtime.compile_count() - trainer.checkpoint_compilations - data, data

    # ---- every batch: recompilations (host counters only) ------------------------------------
    def on_train_batch_start(self, trainer: "TrainerView", module: "XModule", batch: Any, batch_idx: int) -> None:
        samples = batch_size(batch) * self._work.replicas_in_batch  # counted before the step's values are read
        self._samples += samples
        self._interval_samples += samples
        self._work.batch(trainer, module, batch, batch_idx)

    def on_train_batch_end(self, trainer: "TrainerView", module: "XModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._warming_last_step:  # the first step after the first epoch (and its validation)
            self._warming_last_step, self._warm = False, True
            self._compiles_seen, self._data_compiles_seen = self._step_compiles(trainer)
        self._check(trainer, f"training batch {batch_idx}", batch)

    def on_validation_batch_end(self, trainer: "TrainerView", module: "XModule", outputs: Any, batch: Any,
                                batch_idx: int, *args: Any) -> None:
        self._check(trainer, f"validation batch {batch_idx}", batch)

    def on_train_epoch_end(self, trainer: "TrainerView", module: "XModule") -> None:
        self._check(trainer, "the end of the epoch", None)
        if not self._warm:
            self._warming_last_step = True
            self._warn_data_loading(trainer)

    def _warn_data_loading(self, trainer: "TrainerView") -> None:
        """Once, after the first epoch (or at the end of a shorter fit): graphs compiled while the training data was loaded (a
        dataset that runs ops on the device, such as an RL generator calling its policy)."""
        now = _data_counters(trainer)
        graphs = (now["data_compiles"] - self._fit["data_compiles"]) / self._replicas
        if self._data_warned or now["data_reads"] == self._fit["data_reads"] or self.on_recompile == "ignore":
            return
        self._data_warned = True
        seconds = (now["data_compile_s"] - self._fit["data_compile_s"]) / self._replicas
        rank_zero_warn(
            f"The training data ran ops on the XLA device while it was loaded (a dataset calling the model, such "
            f"as an RL generator playing its policy): {_count(graphs)} graph(s) compiled there in the first epoch "
            f"({seconds:.1f} s), counted in xla/compilations and xla/data_loading_compilations. Each device call "
            "with a host read (.item(), .cpu()) runs a graph of its own: batch the policy's calls, or keep the "
            "environment's policy on the CPU (see 'A dataset that runs the model' in docs/troubleshooting.md).")

    def _check(self, trainer: "TrainerView", where: str, batch: Any) -> None:
        """Report the graphs compiled since the last check, once warm. ``batch`` (None at an
        epoch's end): in the first epoch its shapes join those the steps ran with, whether they
        compiled a graph or found one already compiled (in this process, or in the persistent
        cache); after it, looked at only when graphs were compiled, they tell whether the shapes
        are new (XLA compiles for every new shape; torch.compile with dynamic shapes may run one
        on a graph compiled for another)."""
        if not self._compiling:
            return
        count, data = self._step_compiles(trainer)
        new_data, self._data_compiles_seen = data - self._data_compiles_seen, data
        if self._warm and new_data > 0:
            self._report(trainer, f"{where}, while loading data", new_data,
                         "the dataset ran ops on the device while it was loaded, and one of its graphs differed from "
                         "those of the first epoch (a shape, a Python number, or a host read at a new place)")
        if not self._warm:
            if batch is not None:
                self._first_epoch_shapes.add(_shapes(batch))
            self._compiles_seen = count
            return
        if count == self._compiles_seen:
            return
        new, self._compiles_seen = count - self._compiles_seen, count
        shapes = _shapes(batch) if batch is not None else None
        if shapes is not None and shapes not in self._first_epoch_shapes:
            seen = ", ".join(str(s) for s in sorted(self._first_epoch_shapes, key=str)[:4])
            why = f"this batch's shapes {shapes} had no graph compiled for them in the first epoch (there: {seen})"
        else:
            why = ("the inputs' shapes are as in the first epoch, so something inside the step changed (a Python "
                   "number that varies between steps, a branch taken for the first time, a .item() in the step)")
        self._report(trainer, where, new, why)

    def _report(self, trainer: "TrainerView", where: str, new: int, why: str) -> None:
        record = {"step": trainer.global_step, "epoch": trainer.current_epoch, "where": where, "graphs": new,
                  "reason": why}
        self.recompilations.append(record)
        compiler = trainer.strategy.runtime.compiler
        message = (f"{compiler.name} recompiled {new} graph(s) at step {trainer.global_step} (epoch "
                   f"{trainer.current_epoch}, {where}), after the first epoch: {why}. Each recompilation stalls "
                   f"training; {compiler.reasons}.")
        if self.on_recompile == "raise":
            raise RecompilationError(message)
        if self.on_recompile == "warn":
            rank_zero_warn(message)

    # ---- every logging interval ------------------------------------------------------------
    def on_metrics(self, trainer: "TrainerView", module: "XModule", metrics: dict[str, float], step: int) -> None:
        """The interval's figures join the logged values on their way to the loggers."""
        if trainer.state == "fit" and step != self._interval["step"]:
            figures = self._interval_figures(trainer)
            metrics.update(figures)
            # The progress line: MFU where the chip's peak is known, else the achieved FLOP/s.
            shown = {"mfu": figures.get("throughput/mfu"), "flop/s": figures.get("throughput/model_flops_per_second")}
            key = "mfu" if shown["mfu"] is not None else "flop/s"
            if shown[key] is not None:
                trainer.progress_bar_metrics[key] = shown[key]

    def _interval_figures(self, trainer: "TrainerView") -> dict[str, float]:
        now, before = self._mark(trainer), self._interval
        seconds = max(now["time"] - before["time"], 1e-9)
        per_replica = self._replicas
        prefix = trainer.strategy.runtime.compiler.prefix
        # The counters this strategy's compiler keeps (``Strategy.device_counters``), by their figure's name.
        figures = {f"{prefix}/{figure}": (now[counter] - before[counter]) / per_replica
                   for counter, figure in _FIGURES.items() if counter in now}
        if trainer.strategy.runtime.compiles_with_xla:
            figures["xla/data_loading_compilations"] = (now["data_compiles"] - before["data_compiles"]) / per_replica
        figures.update({"throughput/steps_per_second": (now["step"] - before["step"]) / seconds,
                        "throughput/samples_per_second": self._interval_samples / seconds})
        figures.update(self._work.figures(seconds, interval=True))
        memory = trainer.strategy.runtime.memory_info()
        if memory is not None:
            where = "xla" if trainer.strategy.runtime.compiles_with_xla else "device"
            figures.update({f"{where}/memory_bytes_used": memory["bytes_used"],
                            f"{where}/memory_bytes_limit": memory["bytes_limit"]})
        self._interval, self._interval_samples = now, 0
        return {k: float(v) for k, v in figures.items()}

    def on_fit_end(self, trainer: "TrainerView", module: "XModule") -> None:
        if not self._warm:  # a fit shorter than an epoch
            self._warn_data_loading(trainer)
        end, start = self._mark(trainer), self._fit
        steps = end["step"] - start["step"]
        seconds = max(end["time"] - start["time"], 1e-9)
        replicas = self._replicas
        # Compilations, their seconds and transfers per replica (see the class); recompilations
        # as reported (graphs compiled in this process after the first epoch).
        self.totals = {"steps": steps, "seconds": seconds, "steps_per_second": steps / seconds,
                       "samples_per_second": self._samples / seconds, "replicas_in_process": replicas,
                       "compilations": (end["compiles"] - start["compiles"]) / replicas,
                       "compile_seconds": (end["compile_s"] - start["compile_s"]) / replicas,
                       "data_loading_compilations": (end["data_compiles"] - start["data_compiles"]) / replicas,
                       "data_loading_compile_seconds": (end["data_compile_s"] - start["data_compile_s"]) / replicas,
                       "recompilations": sum(r["graphs"] for r in self.recompilations),
                       "compiler": trainer.strategy.runtime.compiler.name}
        if "transfers" in end:  # counted where the compiler keeps the count (XLA)
            self.totals["transfers_per_step"] = (end["transfers"] - start["transfers"]) / max(steps, 1) / replicas
        if "graph_breaks" in end:  # torch.compile's
            self.totals["graph_breaks"] = (end["graph_breaks"] - start["graph_breaks"]) / replicas
        self.totals.update(self._work.figures(seconds, interval=False))
        self.work_summary = self._work.summary(self.totals)
        cache, self.cache_summary = compile_cache.describe(self._cache_counts, _cache_counts(trainer))
        self.totals.update(cache)
        if self.summary and trainer.is_global_zero:
            print(summary_line(self.totals), flush=True)
            print(f"fit: {self.work_summary}", flush=True)
            print(f"fit: {self.cache_summary}", flush=True)

    def state_dict(self) -> dict[str, Any]:
        return {"recompilations": list(self.recompilations)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.recompilations = list(state_dict.get("recompilations", []))


#: ``Strategy.device_counters`` keys -> the logged figures' names (under the compiler's prefix).
_FIGURES = {"compiles": "compilations", "compile_s": "compile_seconds", "executions": "executions",
            "transfers": "transfers_to_host", "graph_breaks": "graph_breaks"}


_NO_DATA_COUNTERS: dict[str, float] = {"data_compiles": 0, "data_compile_s": 0.0, "data_reads": 0}  # read, never changed


def _data_counters(trainer: "TrainerView") -> dict[str, float]:
    """Graphs compiled while a dataset ran ops on the XLA device during loading (host counters;
    zeros for a strategy that does not compile with XLA)."""
    if not trainer.strategy.runtime.compiles_with_xla:
        return _NO_DATA_COUNTERS
    counters = _xla.data_loading_counters()
    return {"data_compiles": counters["compiles"], "data_compile_s": counters["compile_s"],
            "data_reads": counters["reads"]}


def _cache_counts(trainer: "TrainerView") -> dict[str, int]:
    """The persistent compilation cache's counters: XLA's, or torch.compile's (Inductor's)."""
    return _xla.persistent_cache_counts() if trainer.strategy.runtime.compiles_with_xla else compile_cache.inductor_counts()


class _Work:
    """Model FLOPs and tokens of the fit (``xtrainer/flops.py``): counted at the first training
    batch on the host (shapes only), multiplied by the micro-batches run, over the host clock's
    seconds. No device value is read."""

    def __init__(self, trainer: "TrainerView") -> None:
        xla = trainer.strategy.runtime.compiles_with_xla
        spmd = xla and _xla.is_spmd()
        # MPMD: every replica runs the counted step on its own batch; SPMD: one program whose
        # batch and module are the global ones, spread over every device.
        self.replicas = 1 if spmd else max(1, trainer.world_size)
        self.replicas_in_batch = max(1, trainer.world_size)  # the samples a batch stands for: per replica
        self.chips = _xla.spmd_device_count() if spmd else max(1, trainer.world_size)
        self.chip = trainer.strategy.runtime.chip_name()
        self.on_cpu = _xla.requested_device_type() == "CPU" if xla else trainer.strategy.runtime.type == "cpu"
        self.peak = flops.peak_flops(self.chip)
        self.flops = self.tokens = None
        self.note = ""
        self.micro = self.interval_micro = 0
        self.accumulate = trainer.accumulate_grad_batches
        self._counted = False

    def batch(self, trainer: "TrainerView", module: "XModule", batch: Any, batch_idx: int) -> None:
        self.micro += 1
        self.interval_micro += 1
        if self._counted:
            return
        self._counted = True
        self.tokens = flops.declared(module, "tokens_per_step", batch) or flops.tokens_in(batch)
        self.flops = flops.declared(module, "flops_per_step", batch)
        if self.flops is not None:
            self.note = "declared by the module"
        elif not module.automatic_optimization:
            self.note = "not counted under manual optimization: declare flops_per_step on the module"
        elif trainer.strategy.flattens_parameters:
            self.note = (f"not counted under {trainer.strategy.name} (its parameters are flattened shards): declare "
                         "flops_per_step on the module")
        else:
            try:
                self.flops = flops.count_training_step(module, batch, batch_idx, keep=(trainer,),
                                                       precision=trainer.precision)
                self.note = "counted on the meta device"
            except Exception as err:  # noqa: BLE001 - counting must never stop training
                self.note = (f"not counted ({type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}); "
                             "declare flops_per_step on the module")

    def figures(self, seconds: float, interval: bool) -> dict[str, float]:
        micro = self.interval_micro if interval else self.micro
        if interval:
            self.interval_micro = 0
        out: dict[str, float] = {}
        if self.flops:
            achieved = self.flops * micro * self.replicas / seconds
            out["throughput/model_flops_per_second"] = achieved
            if self.peak:
                out["throughput/mfu"] = achieved / (self.peak * self.chips)
        if self.tokens:
            out["throughput/tokens_per_second"] = self.tokens * micro * self.replicas / seconds
        if not interval:
            out = {k.split("/", 1)[1]: v for k, v in out.items()}
        return out

    def summary(self, totals: dict[str, Any]) -> str:
        if not self.flops:
            text = f"model FLOPs {self.note}" if self.note else "model FLOPs unknown"
        else:
            per_step = self.flops * self.accumulate * self.replicas
            text = (f"{per_step:.3g} model FLOPs per optimizer step ({self.note}), "
                    f"{totals['model_flops_per_second']:.3g} FLOP/s achieved")
            if self.peak:
                text += (f"; MFU {100 * totals['mfu']:.1f}% of {self.chips} {self.chip} chip(s) at "
                         f"{self.peak:.3g} bf16 FLOP/s each")
            else:
                what = "the CPU runtime" if self.on_cpu else f"chip {self.chip or 'unknown'}"
                text += f"; no MFU: no peak FLOP/s for {what} (xtrainer.flops.PEAK_BF16_FLOPS, XTRAINER_CHIP)"
        if "tokens_per_second" in totals:
            text += f"; {totals['tokens_per_second']:.4g} tokens/s"
        return text


def replicas_in_process(trainer: "TrainerView") -> int:
    """How many replicas this process runs, whose work torch_xla's process-wide counters add up:
    every replica where they are threads of one process (the CPU runtime with ``devices=N``), else
    1 (one process per replica, or one SPMD program)."""
    return shared_process.current().replicas()


def summary_line(totals: dict[str, Any]) -> str:
    """The line ``fit`` ends with, from ``XlaHealth.totals``. With one replica per process::

        fit: 176 steps in 17.5 s (10.1 steps/s, 644 samples/s); 7 compilations (10.4 s), 0 after the first
        epoch; 0.28 device-to-host transfers per step

    With several replicas in this process, the counts that add up their work are per replica,
    and the line says so; recompilations are the graphs the process compiled after the first
    epoch, as the warnings reported them."""
    replicas = totals.get("replicas_in_process", 1)
    head = (f"fit: {totals['steps']} steps in {totals['seconds']:.1f} s ({totals['steps_per_second']:.1f} steps/s, "
            f"{totals['samples_per_second']:.0f} samples/s); ")
    compiler = totals.get("compiler", "XLA")
    what = "compilations" if compiler == "XLA" else f"{compiler} compilations"
    compilations = f"{_count(totals['compilations'])} {what} ({totals['compile_seconds']:.1f} s)"
    if totals.get("data_loading_compilations"):
        compilations += (f" of which {_count(totals['data_loading_compilations'])} while loading data "
                         f"({totals['data_loading_compile_seconds']:.1f} s)")
    # What else the compiler counts: XLA's transfers, torch.compile's graph breaks.
    others = []
    if "graph_breaks" in totals:
        others.append(f"{_count(totals['graph_breaks'])} graph break(s)")
    if "transfers_per_step" in totals:
        others.append(f"{totals['transfers_per_step']:.2f} device-to-host transfers per step")
    tail = "".join(f"; {other}" for other in others)
    if replicas == 1:
        return head + f"{compilations}, {totals['recompilations']} after the first epoch{tail}"
    return (head + f"per replica ({replicas} in this process): {compilations}{''.join(', ' + o for o in others)}; "
            f"{totals['recompilations']} graph(s) compiled after the first epoch in this process")


def _count(value: float) -> str:
    """A count per replica: an integer, or with one decimal where the replicas shared some
    compilations (one replica compiles a graph, the others find it in the process's cache)."""
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"


def _tensors(batch: Any) -> list[Any]:
    if hasattr(batch, "shape"):
        return [batch]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in _tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in _tensors(v)]
    return []


def _shapes(batch: Any) -> tuple:
    """The batch's tensor shapes, as tuples (host metadata: no device access); a tensor, or a
    tuple or list of them, the short way."""
    if isinstance(batch, torch.Tensor):
        return (tuple(batch.shape),)
    if type(batch) in (tuple, list) and all(isinstance(t, torch.Tensor) for t in batch):
        return tuple(tuple(t.shape) for t in batch)
    return tuple(tuple(t.shape) for t in _tensors(batch))
