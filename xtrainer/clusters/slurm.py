"""SLURM: processes started by ``srun`` run their replica in place, and a job stopped before its
time limit requeues itself and resumes (Lightning's ``SLURMEnvironment`` and its auto-requeue).

A process is one of a managed SLURM job where ``SLURM_NTASKS`` is set and the job is not an
interactive shell (``SLURM_JOB_NAME`` ``bash`` or ``interactive``, Lightning's rule: an
``salloc``/``srun --pty bash`` shell in which the user starts processes as on any machine). A task
that ``srun`` started (``SLURM_STEP_ID`` set) runs its replica in place; the batch script's own
process (no step) is the only one of its job, and starts ``devices`` processes as on any machine
(auto-requeue works there too, with ``--signal=B:USR1``). A task's
rank is ``SLURM_PROCID``, its rank on the node ``SLURM_LOCALID``, its node ``SLURM_NODEID``, the
world ``SLURM_NTASKS``; the tasks on each node come from ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``).
The master is the first host of ``SLURM_NODELIST`` (its grammar expanded here: ``n[1-3,5]``,
``a1,b[01-02]``), or ``MASTER_ADDR`` if set; the port is 15000 plus the last four digits of the job
id, as Lightning derives it (the same in every task, without talking to one another), or
``MASTER_PORT`` if set.

Auto-requeue (on by default, as Lightning): ``requeue_signal`` (SIGUSR1 by default) asks for the
graceful stop SIGTERM asks for (``launch/interrupts.py``): every rank stops at one agreed step,
the checkpoint is written, rank 0 calls ``scontrol requeue`` once, and the fit raises
``TrainingInterrupted``. The requeued job (``SLURM_RESTART_COUNT`` of 1 or more) continues from
the run's ``last`` checkpoint, whatever ``ckpt_path`` the script gives (Lightning's hpc checkpoint
takes precedence the same way); the given one where there is no ``last``. With
``auto_requeue=False`` the signal keeps whatever handler the user gave it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from typing import Any

from xtrainer.clusters.base import ClusterEnvironment

#: Lightning's names of an interactive job: a shell, not a task layout.
INTERACTIVE_JOB_NAMES = ("bash", "interactive")


def expand_hostlist(hostlist: str) -> list[str]:
    """The host names a SLURM node list names, in order (``scontrol show hostnames``'s rules):
    items separated by commas outside brackets, each a name with bracketed ranges of numbers
    (``n[1-3,5]``, ``b[01-02]`` keeps the zeros, ``r[1-2]n[1-2]`` is every combination)."""
    items, depth, current = [], 0, ""
    for char in hostlist.strip():
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"SLURM node list {hostlist!r}: a ']' without its '['.")
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise ValueError(f"SLURM node list {hostlist!r}: a '[' without its ']'.")
    items.append(current)
    hosts: list[str] = []
    for item in items:
        if item:
            hosts.extend(_expand_item(item, hostlist))
    return hosts


def _expand_item(item: str, hostlist: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if match is None:
        return [item]
    head, tail = item[:match.start()], item[match.end():]
    numbers: list[str] = []
    for part in match.group(1).split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"SLURM node list {hostlist!r}: {part!r} is not a number or a range of numbers.")
        width = len(low)
        numbers.extend(f"{n:0{width}d}" for n in range(int(low), int(high or low) + 1))
    return [f"{head}{number}{rest}" for number in numbers for rest in _expand_item(tail, hostlist)]


def tasks_per_node(layout: str) -> list[int]:
    """The tasks on each node from SLURM's ``2(x3),1`` (two on each of three nodes, then one)."""
    counts: list[int] = []
    for part in layout.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"SLURM tasks per node {layout!r}: cannot read {part!r}.")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


class SLURMEnvironment(ClusterEnvironment):
    """The environment of a process that ``srun`` started (Lightning's ``SLURMEnvironment``).

    Args:
        auto_requeue: on ``requeue_signal``, stop at an agreed step, write the checkpoint,
            requeue the job (``scontrol requeue``, once, from rank 0), and resume from ``last``
            when the requeued job starts. False: the signal is left to the user.
        requeue_signal: the signal ``#SBATCH --signal=USR1@90`` sends; SIGUSR1 when None.
    """

    def __init__(self, auto_requeue: bool = True, requeue_signal: signal.Signals | int | None = None) -> None:
        super().__init__()
        if not isinstance(auto_requeue, bool):
            raise TypeError(f"SLURMEnvironment(auto_requeue={auto_requeue!r}): give True or False.")
        signum = signal.SIGUSR1 if requeue_signal is None else requeue_signal
        try:
            signum = signal.Signals(signum)
        except ValueError:
            raise ValueError(f"SLURMEnvironment(requeue_signal={requeue_signal!r}): give a signal "
                             "(signal.SIGUSR1, the default, or the one --signal names).") from None
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"SLURMEnvironment(requeue_signal={signum.name}): that signal cannot be handled; "
                             "give the one #SBATCH --signal names (SIGUSR1 by default).")
        self.auto_requeue, self.requeue_signal = auto_requeue, signum
        self._requeued = False

    # ---- what SLURM says -------------------------------------------------------------------
    @staticmethod
    def detect() -> bool:
        """A task of a SLURM job (``SLURM_NTASKS`` set), not an interactive shell."""
        return "SLURM_NTASKS" in os.environ and SLURMEnvironment.job_name() not in INTERACTIVE_JOB_NAMES

    @property
    def creates_processes_externally(self) -> bool:
        """Whether ``srun`` started this process as a task of a job step (not the batch script)."""
        return self.detect() and ("SLURM_STEP_ID" in os.environ or "SLURM_STEPID" in os.environ)

    @staticmethod
    def job_name() -> str | None:
        return os.environ.get("SLURM_JOB_NAME")

    @staticmethod
    def job_id() -> int | None:
        """The job's id (an array job's own id), None outside a job or in an interactive shell."""
        if SLURMEnvironment.job_name() in INTERACTIVE_JOB_NAMES:
            return None
        value = os.environ.get("SLURM_JOB_ID", "")
        return int(value) if value.isdigit() else None

    def world_size(self) -> int:
        return int(os.environ["SLURM_NTASKS"])

    def global_rank(self) -> int:
        return int(os.environ.get("SLURM_PROCID", "0"))

    def local_rank(self) -> int:
        return int(os.environ.get("SLURM_LOCALID", "0"))

    def node_rank(self) -> int:
        return int(os.environ.get("SLURM_NODEID", "0"))

    def _layout(self) -> list[int]:
        layout = os.environ.get("SLURM_STEP_TASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE")
        return tasks_per_node(layout) if layout else [self.world_size()]

    def local_world_size(self) -> int:
        layout = self._layout()
        return layout[self.node_rank()] if self.node_rank() < len(layout) else layout[-1]

    def num_nodes(self) -> int:
        value = os.environ.get("SLURM_STEP_NUM_NODES") or os.environ.get("SLURM_NNODES")
        return int(value) if value else len(self._layout())

    @property
    def main_address(self) -> str:
        """``MASTER_ADDR``, else the first host of ``SLURM_NODELIST`` (as an address: a node name
        that does not resolve is looked up as SLURM's ``NodeAddr``)."""
        if os.environ.get("MASTER_ADDR"):
            return os.environ["MASTER_ADDR"]
        nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_NODELIST") \
            or os.environ.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        root = self.resolve_root_node_address(nodes)
        try:
            socket.getaddrinfo(root, None)
            return root
        except OSError:
            pass
        # A node name that is no host name (slurm.conf's NodeAddr gives its address): asked of
        # slurmctld once per task, only where the name does not resolve.
        scontrol = shutil.which("scontrol")
        if scontrol:
            try:
                out = subprocess.run([scontrol, "-o", "show", "node", root], capture_output=True, text=True,
                                     timeout=30).stdout
            except (OSError, subprocess.TimeoutExpired):
                out = ""
            match = re.search(r"\bNodeAddr=(\S+)", out)
            if match:
                return match.group(1)
        raise RuntimeError(f"SLURM job: the first node {root!r} of SLURM_NODELIST={nodes!r} is no host name here, and "
                           "scontrol does not give its NodeAddr: export MASTER_ADDR=<its address> in the job script.")

    @property
    def main_port(self) -> int:
        """``MASTER_PORT``, else 15000 plus the last four digits of the job id (Lightning's rule;
        12910 outside a job)."""
        if os.environ.get("MASTER_PORT"):
            return int(os.environ["MASTER_PORT"])
        job = os.environ.get("SLURM_JOB_ID", "")
        return 15000 + int(job[-4:]) if job.isdigit() else 12910

    @staticmethod
    def resolve_root_node_address(nodes: str) -> str:
        """The first host of a SLURM node list."""
        hosts = expand_hostlist(nodes)
        if not hosts:
            raise ValueError(f"SLURM node list {nodes!r} names no host.")
        return hosts[0]

    def validate_settings(self, num_devices: Any, num_nodes: int) -> None:
        """The job's task layout against ``Trainer(devices=..., num_nodes=...)``: one task per
        device, the same number on every node, ``num_nodes`` nodes."""
        layout, nodes = self._layout(), self.num_nodes()
        if len(set(layout)) > 1:
            raise ValueError(f"SLURM started {os.environ.get('SLURM_STEP_TASKS_PER_NODE') or layout} tasks per node, "
                             "not the same number on every node: give srun (or #SBATCH) --ntasks-per-node=<devices>.")
        local = layout[0]
        if isinstance(num_devices, int) and not isinstance(num_devices, bool) and num_devices != local:
            raise ValueError(f"Trainer(devices={num_devices}), but SLURM started {local} task(s) on each node: give "
                             f"devices={local} (or 'auto'), or srun --ntasks-per-node={num_devices}.")
        if num_nodes != nodes:
            raise ValueError(f"Trainer(num_nodes={num_nodes}), but the SLURM job step runs on {nodes} node(s): give "
                             f"num_nodes={nodes}, or srun --nodes={num_nodes} (#SBATCH --nodes={num_nodes}).")

    # ---- auto-requeue ----------------------------------------------------------------------
    def stop_signals(self) -> tuple[int, ...]:
        return (int(self.requeue_signal),) if self.auto_requeue else ()

    def stopped(self, signum: int) -> None:
        """After the stop on the requeue signal (a fit's, once its checkpoint is written; an
        evaluation's, at once): rank 0 requeues the job (once; SLURM then ends every task of this
        run, and starts the job's script again)."""
        if not self.auto_requeue or signum != self.requeue_signal or self._requeued or self.global_rank() != 0:
            return
        job = _requeue_id()
        if job is None:
            print("xtrainer: SLURM requeue signal received, but this process is in no SLURM job (SLURM_JOB_ID is "
                  "unset): nothing requeued.", file=sys.stderr, flush=True)
            return
        self._requeued = True
        try:
            done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
            code, said = done.returncode, done.stderr.strip()
        except (OSError, subprocess.TimeoutExpired) as err:
            code, said = -1, str(err)
        # scontrol ended by a signal: SLURM's own, sent to this job's processes (scontrol among them)
        # as it requeues the job, before scontrol could say it had
        if code == 0 or code in (-signal.SIGTERM, -signal.SIGKILL):
            print(f"xtrainer: requeued SLURM job {job}; when it starts again, a fit resumes from its last checkpoint.",
                  file=sys.stderr, flush=True)
        else:
            print(f"xtrainer: scontrol requeue {job} failed ({said or f'exit {code}'}): the checkpoint is written; "
                  "submit the job again (it resumes with ckpt_path='last'), and check #SBATCH --requeue.",
                  file=sys.stderr, flush=True)

    def fit_ckpt_path(self, ckpt_path: Any) -> Any:
        """``"last"`` on a requeued job (``SLURM_RESTART_COUNT`` of 1 or more) with auto-requeue on."""
        if self.auto_requeue and int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0:
            return "last"
        return ckpt_path


def _requeue_id() -> str | None:
    """The id ``scontrol requeue`` takes: ``<array job>_<task>`` for an array task (Lightning's)."""
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array and "SLURM_ARRAY_TASK_ID" in os.environ \
        else os.environ.get("SLURM_JOB_ID")
    return job if job and re.fullmatch(r"[0-9_]+", job) else None
