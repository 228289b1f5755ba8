"""Several replicas on torch_xla's CPU runtime: N threads of one process, made to work.

``PJRT_DEVICE=CPU CPU_NUM_DEVICES=N`` gives N virtual devices in one process, and ``torch_xla``
runs MPMD replicas there as one thread per device. Out of the box a training loop deadlocks (XLA
aborts the process after 10 s of waiting at a collective). Four causes, and what this package does
about each:

1. **Different executables.** XLA's CPU backend matches the halves of a collective by channel id,
   or, without one, by the id of the compiled module; torch_xla's MPMD collectives carry no
   channel id, so two replicas that compiled the same graph separately never meet. Here
   all-reduce, all-gather and reduce-scatter are lowered *with* channel ids (one channel per kind,
   on 1-D views, since XLA gives every collective of a channel one layout: ``collectives.py``),
   and graph cuts are serialised so that one replica compiles and the others hit the cache.
2. **Thread-pool starvation.** Cheap executables run inline on torch_xla's thread pool
   (``XLA_THREAD_POOL_SIZE``, default: the core count). With more replicas than threads a
   collective waits forever, so the pool gets at least 16 threads and 4 per replica.
3. **Freeing a busy buffer while holding the GIL**, at the end of ``torch_xla.sync()``: the cut
   here waits for this replica's execution with the GIL released before it lets Python go on.
4. **Donated buffers freed under the cut's lock:** ``XLA_ENABLE_PARAM_ALIASING=0``.

Besides: ``torch.distributed`` keeps one world per thread (DDP) with distinct process-group names,
modules are built under a lock (torch's CPU random generator is process-global), host-side
rendezvous (barriers, ``mesh_reduce``) meet in Python instead of through XLA collectives, and DDP
starts through that rendezvous and the serialised cut.

How it runs: the calling process (``launch`` below, chosen by ``strategies/launchers/__init__.py``) starts one
fresh process (``spawn``) with the environment above; there ``replicas.py`` installs everything
before any replica exists, then one thread per device runs the replica. The caller's own XLA
runtime is never touched, so ``devices=N`` works from a script, a notebook or a test session that
already used an XLA device. If a replica fails, the others are stopped at their next graph cut or
barrier, and the process ends within a few seconds; the caller then raises the first replica's
error.

What strategies need to know of it they ask the process (``strategies/shared_process.py``: how
many replicas it runs, the lock to build modules under, how DDP starts), where ``replicas.py``
installs its answers; nothing outside ``strategies/launchers/__init__.py`` imports this package. It relies on
private torch_xla internals (a section of their own in ``xtrainer/_xla.py``, the only module that
imports torch_xla) checked with torch_xla 2.9 only, so ``launch`` refuses any other version rather
than risk a hang. Everything here is switched on only for the CPU device type with more than one
replica (``applies``) and only inside that dedicated process; TPUs and other PJRT devices never
meet its effects.

- ``__init__.py``: the calling process (whether it applies, the new process's environment, launch).
- ``replicas.py``: the replicas' process: what the threads share, the serialised cut, host-side
  rendezvous, DDP's start, stopping every replica when one fails.
- ``collectives.py``: all-reduce, all-gather and reduce-scatter lowered with channel ids.
"""

from __future__ import annotations

import os
from typing import Callable

from xtrainer._lazy_xla import xla as _xla
from xtrainer.strategies.launchers.cpu_threads.replicas import PeerReplicaFailed, check_version, process_main
from xtrainer.strategies.launchers.processes import free_port, run_in_new_process

#: How long XLA's CPU runtime lets a replica wait at a collective for the others before it aborts
#: the process (fixed inside XLA; measured with torch_xla 2.9).
XLA_COLLECTIVE_WAIT_SECONDS = 10


def applies(devices: int | None) -> bool:
    """Whether ``devices`` replicas need this package: the CPU runtime with more than one."""
    return devices is not None and devices > 1 and _xla.requested_device_type() == "CPU"


def environment(devices: int) -> dict[str, str]:
    """The variables the replicas' process starts with (the runtime reads them at start-up)."""
    pool = max(_int_env("XLA_THREAD_POOL_SIZE"), 4 * devices, 16)
    port = free_port()  # a port of its own for torch.distributed's xla:// rendezvous
    return {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices), "XLA_THREAD_POOL_SIZE": str(pool),
            "XLA_ENABLE_PARAM_ALIASING": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def _int_env(name: str) -> int:
    try:
        return int(os.environ.get(name, "0"))
    except ValueError:
        return 0


def launch(job: Callable[[], None], devices: int) -> int:
    """Run ``job()`` in ``devices`` replica threads of a new process; return its exit code.

    ``job`` must pickle. It reports its own result or error (see ``launch.CpuThreadReplicas``).
    """
    check_version()
    return run_in_new_process(process_main, (job, devices), environment(devices), f"devices={devices}")


__all__ = ["XLA_COLLECTIVE_WAIT_SECONDS", "PeerReplicaFailed", "applies", "check_version", "environment", "launch"]
