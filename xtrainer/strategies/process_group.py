"""torch.distributed's default process group as the native strategies use it: whether this
process is one of a group (torchrun's, or ``NativeProcesses``'), the store the group meets in
(one per torchrun restart; the calling process's for ``devices=N``), joining it and leaving it,
and the ``ProcessGroup`` collectives over it.

The launcher that starts a group's processes (``strategies/launchers/native_processes.py``) tells
this module where the calling process stands in it (``set_caller_rank``); the strategy joins the
group through ``join``.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection

from xtrainer.launch import interrupts
from xtrainer.runtimes.eager import EagerRuntime, to_host
from xtrainer.strategies.collectives import Collectives, HostObjects

_REDUCE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}

#: Set in the processes ``NativeProcesses`` starts (they have torch's variables too, but report
#: to the calling process rather than running in place).
REPLICA_OF_CALLER = "XTRAINER_NATIVE_REPLICA"


def in_process_group_env() -> bool:
    """Whether this process was started as one of a group, with torch's variables."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def under_torchrun() -> bool:
    """Whether torchrun (or a launcher like it) started this process as one of a group."""
    return in_process_group_env() and REPLICA_OF_CALLER not in os.environ


def _store_of_this_attempt(store: dist.Store) -> dist.Store:
    """The key-value store the process group meets in, with a prefix of its own for each of
    torchrun's restarts where every process can agree on one.

    torchrun keeps its store (and the keys in it) across ``--max-restarts``: a restarted process
    could read the address a killed process of the previous attempt published and fail to connect
    ("Gloo connectFullMesh failed ... Connection refused"), depending on which process writes
    first. On one host every process has the same ``TORCHELASTIC_RESTART_COUNT``, so the restart
    count makes a fresh prefix. Across hosts the counts can differ (an agent that restarts because
    another host's worker failed does not count it), so there the keys stay as torch sets them;
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (c10d rendezvous) gives each attempt a new store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return dist.PrefixStore("default_pg", store)  # a store of this attempt's own (as torch names it)
    if os.environ.get("LOCAL_WORLD_SIZE") != os.environ.get("WORLD_SIZE"):
        return dist.PrefixStore("default_pg", store)  # several hosts: see above
    return dist.PrefixStore(f"default_pg/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def env_ranks() -> tuple[int, int, int]:
    """(global rank, world size, local rank) of a process started with torch's variables."""
    return (int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")),
            int(os.environ.get("LOCAL_RANK", "0")))


#: A key of the store the group meets in: each started rank adds 1 once its rendezvous is done.
JOINED_KEY = "xtrainer/joined"


class CallerRank:
    """Rank 0 of ``NativeProcesses``, in the calling process: the store its group meets in, the
    world size, and the wait for the other ranks (raises when one cannot come)."""

    def __init__(self, store: dist.Store, world_size: int, wait_for_peers: Callable[[], None]) -> None:
        self.store, self.world_size, self.wait_for_peers = store, world_size, wait_for_peers


#: While the calling process runs rank 0 of ``NativeProcesses``: its place in the group.
_caller_rank: CallerRank | None = None


def set_caller_rank(rank: CallerRank | None) -> None:
    """The calling process's place in the group its launcher started (None once rank 0 has run):
    given here, not in ``os.environ``, which stays as it was (a later Trainer would take torch's
    variables there for torchrun's)."""
    global _caller_rank
    _caller_rank = rank


def device_index() -> int:
    """The index of this process's device on its host: torch's ``LOCAL_RANK`` in a process started
    as one of a group, else 0 (the calling process is rank 0 of the group it started)."""
    return int(os.environ["LOCAL_RANK"]) if in_process_group_env() and _caller_rank is None else 0


def join(runtime: EagerRuntime, device: torch.device, timeout_seconds: float) -> bool:
    """Join the default process group where this process is one of several: rank 0 of
    ``NativeProcesses`` in the calling process (the store it serves, once every started rank has
    joined it), a rank it started, or one of torchrun's (``env://``). Returns whether this call
    made the group (its maker destroys it); False where there is none to join or it exists."""
    caller = _caller_rank
    timeout = datetime.timedelta(seconds=timeout_seconds)
    options: dict[str, Any] = {}
    if device.type != "cpu":
        options["device_id"] = device  # untested here: no accelerator
    if caller is not None and not dist.is_initialized():  # rank 0 of NativeProcesses, in the calling process
        caller.wait_for_peers()
        dist.init_process_group(runtime.process_group_backend(), store=dist.PrefixStore("default_pg", caller.store),
                                rank=0, world_size=caller.world_size, timeout=timeout, **options)
        return True
    if in_process_group_env() and int(os.environ["WORLD_SIZE"]) > 1 and not dist.is_initialized():
        with interrupts.ending_at_once():  # joining the process group: nothing to save yet
            store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
            store.set_timeout(timeout)
            if REPLICA_OF_CALLER in os.environ:  # a rank of NativeProcesses: its caller serves the store
                store.add(JOINED_KEY, 1)  # rank 0 waits for every rank's, watching that none ended
                group_store = dist.PrefixStore("default_pg", store)
            else:
                group_store = _store_of_this_attempt(store)
            dist.init_process_group(runtime.process_group_backend(), store=group_store, rank=rank,
                                    world_size=world_size, timeout=timeout, **options)
        return True
    return False


def leave(barrier: bool) -> None:
    """The caller's process group gone at the end of its stage (the next launch makes its own);
    ``barrier``: after every rank has reached this point (a rank that closes its connections
    while a peer still reads its last message aborts that peer, on gloo)."""
    if not dist.is_initialized():
        return
    try:
        if barrier:
            dist.barrier()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Collectives over the default process group.
# ---------------------------------------------------------------------------------------------
class ProcessGroup(HostObjects, Collectives):
    """The replicas of a native run: one process each, agreeing over ``torch.distributed``'s
    default process group (none with one process). Tensor collectives run when called (there is
    no graph to record them in): the loop calls them only where it reads values anyway."""

    def __init__(self, device: torch.device, agreement_seconds: float = 0.0) -> None:
        self.device, self.agreement_seconds = device, agreement_seconds

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0")) if dist.is_initialized() else 0

    @property
    def node_rank(self) -> int:
        if not dist.is_initialized():
            return 0
        if "GROUP_RANK" in os.environ:  # torchrun's node index
            return int(os.environ["GROUP_RANK"])
        return self.global_rank // int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))

    def to_cpu(self, data: Any) -> Any:
        return to_host(data)

    def reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        # a clone, on the group's device: a number logged with sync_dist is a CPU tensor, which
        # nccl (and a native device's own backend) cannot reduce (untested here: gloo takes both)
        reduced = tensor.to(self.device, copy=True)
        dist.all_reduce(reduced, op=getattr(dist.ReduceOp, _REDUCE_OPS[op]))
        return reduced

    def any_replica(self, vote: int) -> torch.Tensor | int:
        return self.reduce(torch.tensor([vote], dtype=torch.int64, device=self.device), "max")

    def agree(self, vote: int, first: torch.Tensor | None) -> tuple[torch.Tensor | int, torch.Tensor | None]:
        """``agree_later`` waited for at once: the stop vote and the first bad step in one
        all-reduce (its proposal for the next agreement unused)."""
        finish = self.agree_later(vote, first, 0)
        return (vote, first) if finish is None else finish()[:2]

    def agree_later(self, vote: int, first: torch.Tensor | None, next_step: int
                    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] | None:
        """The all-reduce (min) of ``[-vote, next_step, first]`` (so the largest vote), started
        without waiting (``async_op``); what this returns waits for it. A blocking one waits for the slowest
        replica: on gloo, once every 10 steps of about 1 ms, it cost 50-75 us of CPU per step here,
        started early and waited later 10-30; ``agreement_seconds`` spaces them out further."""
        if self.world_size == 1:
            return None
        head = torch.tensor([-vote, next_step], dtype=torch.int64, device=self.device)
        both = head if first is None else torch.cat([head, first.to(torch.int64)])
        work = dist.all_reduce(both, op=dist.ReduceOp.MIN, async_op=True)

        def finish() -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
            work.wait()
            return -both[:1], None if first is None else both[2:], both[1:2]

        return finish

    def all_gather_tensors(self, data: Any, sync_grads: bool = False) -> Any:
        def gather(tensor: torch.Tensor) -> torch.Tensor:
            if self.world_size == 1:
                return tensor.unsqueeze(0)
            if sync_grads:  # backward sends each replica the gradient of its own part
                from torch.distributed.nn.functional import all_gather

                return torch.stack(all_gather(tensor.contiguous()))
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
            dist.all_gather(parts, tensor.contiguous())
            return torch.stack(parts)

        return apply_to_collection(data, torch.Tensor, gather)

