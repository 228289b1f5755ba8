"""Goodput: where a run's wall time goes, and what its restarts cost.

``Goodput`` (added by the Trainer: ``enable_goodput=True``) attributes every second of a fit, on
the host clock, to one of:

- ``startup``: from the start of the process (the one ``xtrainer fit`` or the script runs in; a
  restart loop starts a new one each time) to the end of the first training step: imports, the
  runtime, restoring the checkpoint, the sanity check and the first compilations. Python started
  by a shell's ``exec`` keeps the shell's process, and its start (the kernel keeps no time of an
  ``exec``): where ``XTRAINER_STARTED_AT`` (wall-clock seconds) was set just before the ``exec``,
  as ``./dev`` sets it, startup counts from there, and what the shell did before (``./dev``'s
  first install) is not counted;
- ``compiling``: XLA compilations after that (torch_xla's ``CompileTime``, per replica);
- ``data``: waiting for the next batch (from the end of one batch's hooks to the start of the
  next, less what validation and checkpoints took in between);
- ``checkpointing``: ``Trainer.save_checkpoint`` (every save, from any callback or hook);
- ``validating``: validation during the fit;
- ``training``: the rest, the steps themselves.

Each run writes ``goodput.json`` in its run folder (rank 0; replaced atomically and synced at a
logging step once every ``write_every`` seconds at most, and at the end: a killed run leaves its
state of at most that long before). At the end of ``fit`` one line sums
this run, and one the lineage: every ``version_*/goodput.json`` under the same runs root (the
runs a restart loop makes), with the **steps lost to preemption**: for each resumed run, the
global step the run before it had reached (at its interrupt; when it was killed, as of its last
write) minus the step of the checkpoint it resumed from.

Only host clock readings and torch_xla's host counters: no host sync, nothing added to a step.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import time
from typing import TYPE_CHECKING, Any, Iterator

from xtrainer.callbacks.base import Callback
from xtrainer.checkpoint.storage import replace_text
from xtrainer.trainer_view import TrainerView

if TYPE_CHECKING:
    from xtrainer.module import XModule

FILE = "goodput.json"
BUCKETS = ("startup", "compiling", "data", "checkpointing", "validating", "training")
_IMPORTED_AT = time.time()
#: Wall-clock seconds set just before a shell's ``exec`` of Python (``./dev`` sets it): when
#: Python started, which the pid's start time (the shell's) does not say. Read once, and
#: taken out of the environment, so that processes this one starts never take it for their own.
STARTED_AT_VARIABLE = "XTRAINER_STARTED_AT"
_EXEC_STAMP = os.environ.pop(STARTED_AT_VARIABLE, None)
#: When the last fit of this process ended: a second fit's startup counts from there.
_last_fit_ended_at = 0.0


def process_started_at() -> float:
    """This process's start, as wall-clock seconds: the ``XTRAINER_STARTED_AT`` set before the
    ``exec`` that started Python (module docstring), else the pid's start (Linux: ``/proc``;
    elsewhere the time xtrainer was imported, a little later)."""
    pid_started = _pid_started_at()
    try:
        stamp = float((_EXEC_STAMP or "").replace(",", "."))  # bash's EPOCHREALTIME has the locale's decimal point
    except ValueError:
        return pid_started
    # Set in this process (after its pid started: /proc's boot time is whole seconds) and not in the future.
    return stamp if pid_started - 1.0 <= stamp <= time.time() else pid_started


def _pid_started_at() -> float:
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime: field 22 of stat, the 20th after the command name
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


class Goodput(Callback):
    """Accounts the fit's wall time (module docstring). ``record`` is this run's account;
    ``summary=False`` keeps the end-of-fit lines to ``summary`` (the Trainer prints them when
    ``enable_xla_health`` is on, with the other summary lines). ``write_every``: seconds at
    least between two writes of ``goodput.json`` during the fit (a synced write costs about a
    millisecond of the training thread; 0 writes at every logging step)."""

    _phase = "idle"  # until a fit starts, and after it

    def __init__(self, summary: bool = True, write_every: float = 10.0) -> None:
        if not isinstance(write_every, (int, float)) or isinstance(write_every, bool) or write_every < 0:
            raise ValueError(f"Goodput(write_every={write_every!r}): give seconds, 0 or more.")
        self.print_summary = summary  # the two lines at the end of fit (rank 0)
        self.write_every = float(write_every)
        self.process_started_at = process_started_at()  # the calling process: the one restarted
        self.record: dict[str, Any] = {}
        self.summary = ""
        self._active = False

    # ---- the clock ------------------------------------------------------------------------------
    def _switch(self, phase: str) -> None:
        """Close the current phase (the compile seconds since the last switch go to
        ``compiling``) and open ``phase``."""
        now, compiled = time.time(), self._compile_seconds() / self._replicas
        wall, compile_s = now - self._since, compiled - self._compiled
        seconds = self.record["seconds"]
        if self._phase == "startup":
            seconds["startup"] += wall
            self.record["startup_compiling"] += compile_s
        else:
            seconds["compiling"] += compile_s
            if self._phase in self._steps:
                self._steps[self._phase] += wall
                # The steps compile, the loader does not: their compile seconds come out of training.
                training = self._steps["training"] - compile_s
                self._steps["training"], data = max(0.0, training), self._steps["data"] + min(0.0, training)
                seconds["training"] += self._steps["training"]
                seconds["data"] += max(0.0, data)
                self._steps = {"data": 0.0, "training": 0.0}
            else:
                seconds[self._phase] += max(0.0, wall - compile_s)
        self._since, self._compiled, self._phase = now, compiled, phase

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute the time inside to ``name``, then go back to what ran before."""
        if not self._active or self._phase == "startup":
            yield
            return
        previous = self._phase
        self._switch(name)
        try:
            yield
        finally:
            self._switch(previous)

    # ---- hooks ------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: "TrainerView", module: "XModule") -> None:
        from xtrainer.callbacks.health import replicas_in_process

        self._replicas = replicas_in_process(trainer)
        first = _last_fit_ended_at == 0.0
        self._since = self.process_started_at if first else _last_fit_ended_at
        self._compile_seconds = trainer.strategy.runtime.compile_seconds
        self._compiled = 0.0 if first else self._compile_seconds() / self._replicas
        self._phase, self._active = "startup", True
        # Wall seconds of the batches' waits and steps since the last _switch, which splits out
        # their compile seconds: read there, not on every batch.
        self._steps = {"data": 0.0, "training": 0.0}
        self._written_at = -math.inf  # the first logging step writes
        self._folder, self._root = trainer.log_dir, trainer.runs_root
        self._write = trainer.is_global_zero
        self.record = {"run": os.path.basename(trainer.log_dir), "process_started_at": self.process_started_at,
                       "resumed_from_step": trainer.global_step if trainer.ckpt_path else None,
                       "resumed_from": trainer.ckpt_path, "last_step": trainer.global_step, "status": "running",
                       "startup_compiling": 0.0, "seconds": dict.fromkeys(BUCKETS, 0.0)}

    def on_train_batch_start(self, trainer: "TrainerView", module: "XModule", batch: Any, batch_idx: int) -> None:
        if self._phase == "data":  # between a batch's wait and its step: a clock reading only (see _steps)
            now = time.time()
            self._steps["data"] += now - self._since
            self._since, self._phase = now, "training"
        elif self._active and self._phase != "startup":
            self._switch("training")

    def on_train_batch_end(self, trainer: "TrainerView", module: "XModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # From here to the next batch: the other hooks, then the loader.
        if self._phase == "training":
            now = time.time()
            self._steps["training"] += now - self._since
            self._since, self._phase = now, "data"
        elif self._active:
            self._switch("data")  # the first step's end closes the startup

    def on_validation_start(self, trainer: "TrainerView", module: "XModule") -> None:
        if self._active and trainer.state == "fit" and not trainer.sanity_checking and self._phase != "startup":
            self._resume_to = self._phase
            self._switch("validating")

    def on_validation_end(self, trainer: "TrainerView", module: "XModule") -> None:
        if self._active and self._phase == "validating":
            self._switch(getattr(self, "_resume_to", "data"))

    def on_metrics(self, trainer: "TrainerView", module: "XModule", metrics: dict[str, float], step: int) -> None:
        if self._active and trainer.state == "fit":
            self.record["last_step"] = max(self.record["last_step"], trainer.global_step)
            now = time.monotonic()
            if now - self._written_at >= self.write_every:
                self._written_at = now
                self._switch(self._phase)  # the account so far, compile seconds split out
                self._save()

    def on_exception(self, trainer: "TrainerView", module: "XModule", exception: BaseException) -> None:
        if self._active:
            from xtrainer.launch.interrupts import TrainingInterrupted

            self.record["status"] = "interrupted" if isinstance(exception, TrainingInterrupted) else "failed"
            self.record["last_step"] = trainer.global_step

    def on_fit_end(self, trainer: "TrainerView", module: "XModule") -> None:
        if not self._active:
            return
        self.record["status"] = "finished"
        self.record["last_step"] = trainer.global_step
        self._finish()
        if trainer.is_global_zero and self.print_summary:
            print(self.summary, flush=True)

    def teardown(self, trainer: "TrainerView", module: "XModule", stage: str) -> None:
        if self._active and self.record["status"] != "finished":
            self._finish()  # interrupted or failed: the account so far, for the next run's summary
        self._active, self._phase = False, "idle"

    # ---- the record -----------------------------------------------------------------------------
    def _finish(self) -> None:
        global _last_fit_ended_at
        self._switch(self._phase)
        self.record["ended_at"] = _last_fit_ended_at = time.time()
        self._save()
        runs = lineage(self._root)
        self.summary = summarize(self.record, runs)

    def _save(self) -> None:
        if not self._write or (self.record["status"] == "failed" and self.record["last_step"] == 0
                               and self.record["resumed_from_step"] is None):
            return  # failed before training anything: the run leaves no folder behind (loop/stages.py)
        record = dict(self.record, seconds=dict(self.record["seconds"]), updated_at=time.time())
        if record["status"] == "running":  # the clock so far, as a killed run would leave it
            open_phase = time.time() - self._since
            key = "startup" if self._phase == "startup" else self._phase
            record["seconds"][key] += open_phase
        try:  # whole or not at all: a reader sees the old account or the new one
            replace_text(os.path.join(self._folder, FILE), json.dumps(record))
        except OSError:
            pass  # accounting must never stop training

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()
                if k in ("process_started_at", "record", "summary", "_active", "print_summary", "write_every")}


@contextlib.contextmanager
def timing(trainer: "TrainerView", phase: str) -> Iterator[None]:
    """``with goodput.timing(trainer, "checkpointing"):`` around work the loop does not see."""
    owner = next((cb for cb in trainer.callbacks if isinstance(cb, Goodput)), None)
    if owner is None:
        yield
        return
    with owner.phase(phase):
        yield


def lineage(runs_root: str) -> list[dict[str, Any]]:
    """Every run's account under ``runs_root`` (its ``version_*`` folders), oldest first."""
    runs = []
    for path in glob.glob(os.path.join(glob.escape(runs_root), "version_*", FILE)):
        try:
            with open(path) as f:
                runs.append(json.load(f))
        except (OSError, ValueError):
            continue  # a folder without a readable account: not counted
    return sorted(runs, key=lambda r: r.get("process_started_at", 0.0))


def steps_lost(runs: list[dict[str, Any]]) -> int:
    """Steps trained again after restarts: for each resumed run, the step the run before it had
    reached minus the step it resumed from."""
    lost = 0
    for before, run in zip(runs, runs[1:]):
        if run.get("resumed_from_step") is not None:
            lost += max(0, int(before.get("last_step", 0)) - int(run["resumed_from_step"]))
    return lost


def _share(seconds: dict[str, float]) -> tuple[float, str]:
    total = sum(seconds.values())
    parts = [f"{name} {seconds[name]:.1f} s ({100 * seconds[name] / total:.0f}%)" for name in BUCKETS
             if seconds.get(name, 0.0) > 0.05 or name == "training"] if total > 0 else []
    return total, ", ".join(parts)


def summarize(record: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    """Two lines: this run's account, and its lineage's."""
    total, parts = _share(record["seconds"])
    text = (f"goodput: this run {total:.1f} s: {parts}; of startup, {record['startup_compiling']:.1f} s compiling")
    if len(runs) > 1:
        seconds = {name: sum(r["seconds"].get(name, 0.0) for r in runs) for name in BUCKETS}
        all_total, _ = _share(seconds)
        training = seconds["training"] / all_total if all_total else 0.0
        restarts = sum(1 for r in runs if r.get("resumed_from_step") is not None)
        text += (f"\ngoodput: {len(runs)} runs under this root ({restarts} resumed): {100 * training:.0f}% of "
                 f"{all_total:.1f} s training, {seconds['startup']:.1f} s starting, "
                 f"{steps_lost(runs)} steps lost to preemption")
    return text
