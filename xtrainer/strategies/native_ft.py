"""``"native_ft"``: fault-tolerant data parallel on torchft. Replica groups train under a
lighthouse (``torchft_lighthouse``); a group that dies does not stop the others, and a restarted
one heals from a live peer's memory, without a checkpoint.

Each replica group is one process, started on its own (by hand, by a supervisor, a scheduler's
job step), with the lighthouse's address and its group index; no group waits for another to
start. Every step, the groups that are alive agree on a quorum (torchft's ``Manager``, over the
lighthouse), all-reduce their gradients through the manager (one flat buffer, averaged over the
groups in the quorum), and step the optimizer only where the manager says the step is committed.
torchft's ``DistributedDataParallel`` wrapper is not used: it failed the survivor when a peer died
in the middle of its all-reduce, where the manager's own all-reduce reports the failure and
leaves the step uncommitted.

**The data rule.** Group ``g`` of ``num_replica_groups`` reads shard ``g`` of each global batch,
the batches ``native_ddp`` gives rank ``g`` of that many processes (the same order, re-shuffled
each epoch with the run's seed). Each of its batches is trained at most once, and a batch is left
untrained only when:

- its step was not committed (a peer died during the step's all-reduce): none of that step's
  batches are trained, on any group; the step's number is in ``uncommitted_steps``;
- its group was down for that step: the survivors do not take over its shard.

A healed group continues at the step its peers are in, with its own shard of that step. Nothing
is ever trained twice, nothing is skipped but the above, and each group's
``uncommitted_steps``/``healed_at`` say which.

**Healing.** A group (re)started while others train joins their quorum at its first step: the
lighthouse names a peer that is ahead of it, which serves the fit's whole state as a checkpoint
(what a checkpoint on disk holds: the module, the optimizers, the schedulers, the loop's position,
the generators; not the callbacks' states, which stay with the group that wrote them) over HTTP; the new group continues from it exactly as from a
checkpoint file. At the first start of the whole job group 0 is that peer for the others at step
0, so every group starts from group 0's weights and seed. Checkpoints on disk are written as by
``native``: each group into its own run folder. Restart the whole job from them (every group with
``ckpt_path``); a lost group restarted alone needs none (and should not be given one).
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from xtrainer.strategies.base import optimizer_call
from xtrainer.strategies.data import DeviceData, distribute_dataloader
from xtrainer.strategies.native import NativeSingle
from xtrainer.strategies.parallel import ParallelStrategy

#: The environment variables the strategy reads where its arguments are not given (torchft's name
#: for the lighthouse's address; the group index as torchtitan's fault-tolerance scripts name it).
LIGHTHOUSE_ENV, GROUP_ENV, GROUPS_ENV = "TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS"


class LighthouseLost(RuntimeError):
    """No quorum came from the lighthouse (it is down, or unreachable) within the quorum timeout."""


def _cloned(state: Any) -> Any:
    """``state`` with every tensor copied: what a peer is served must not change under it while
    this group trains on (torchft serves the tensors as they are, on the CPU)."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, state)


class NativeFaultTolerant(NativeSingle, ParallelStrategy):
    """Fault-tolerant data parallel over replica groups of one process each (torchft 0.2).

    Start one process per group, each with ``strategy=NativeFaultTolerant(replica_group=g, ...)``
    (or ``"native_ft"`` and the environment variables), and a lighthouse first:
    ``torchft_lighthouse --min_replicas 1 --bind [::]:29510``.

    Args:
        lighthouse: the lighthouse's address (``http://host:port``); default
            ``$TORCHFT_LIGHTHOUSE``.
        replica_group: this group's index, ``0 <= replica_group < num_replica_groups``; default
            ``$REPLICA_GROUP_ID``.
        num_replica_groups: how many groups share the data (each reads its fixed shard); default
            ``$NUM_REPLICA_GROUPS``.
        min_replica_groups: the fewest live groups that commit a step.
        timeout_seconds: how long an all-reduce, a commit or a state transfer may take.
        quorum_timeout_seconds: how long a step waits for its quorum (the lighthouse's answer)
            before the fit fails with ``LighthouseLost``.
        connect_timeout_seconds: how long connecting to the lighthouse may take.
        heartbeat_ms: how often the group tells the lighthouse it is alive (the lighthouse's
            ``--heartbeat_timeout_ms`` decides when a silent group is dropped).
        hostname: the name the other groups reach this one by (its store, its state for a
            healing peer); default ``socket.gethostname()``, as torchft's.
        compile: run the module's ``forward`` through ``torch.compile``, as ``native``.
        compile_kwargs: passed to ``torch.compile``.
    """

    name = "native_ft"
    runs_standalone = False  # it needs a lighthouse started first

    def __init__(self, lighthouse: str | None = None, replica_group: int | None = None,
                 num_replica_groups: int | None = None, min_replica_groups: int = 1,
                 timeout_seconds: float = 60.0, quorum_timeout_seconds: float = 60.0,
                 connect_timeout_seconds: float = 10.0, heartbeat_ms: int = 100, hostname: str | None = None,
                 compile: bool = False, compile_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(compile=compile, compile_kwargs=compile_kwargs, timeout_seconds=timeout_seconds)
        self.lighthouse = lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        self._given = (replica_group if replica_group is not None else os.environ.get(GROUP_ENV),
                       num_replica_groups if num_replica_groups is not None else os.environ.get(GROUPS_ENV))
        self.replica_group, self.num_replica_groups = 0, 1  # checked and set by configure()
        self._min_replica_groups = min_replica_groups
        self.min_replica_groups = min_replica_groups
        self.quorum_timeout_seconds, self.connect_timeout_seconds = quorum_timeout_seconds, connect_timeout_seconds
        self.heartbeat_ms = heartbeat_ms
        self.hostname = hostname or socket.gethostname()
        #: The loop's steps (``global_step`` when each began) that were not committed: their
        #: batches were trained by no group.
        self.uncommitted_steps: list[int] = []
        #: The step this group healed at from a live peer (None: it started with the others, or
        #: from its own checkpoint).
        self.healed_at: int | None = None
        self._manager: Any = None
        self._store: Any = None
        self._pg: Any = None
        self._snapshot: Callable[[], dict[str, Any]] | None = None
        self._peer_state: dict[str, Any] | None = None
        self._quorum_due = False  # the next training batch begins a step: its quorum is to be taken
        self._joining = False
        self._wrapped: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._step_seen = 0  # the loop's step of the coming optimizer step (for uncommitted_steps)

    def _check_accelerator(self, accelerator: str, num_nodes: int) -> None:
        """As ``native``, then this strategy's own settings (when the Trainer is made): the
        lighthouse's address and this group's place, each refused in one line."""
        super()._check_accelerator(accelerator, num_nodes)
        if not self.lighthouse:
            raise ValueError(f"{type(self).__name__}: give lighthouse='http://host:port' (or set ${LIGHTHOUSE_ENV}), "
                             "the address of a running torchft_lighthouse.")
        group, groups = self._given
        try:
            self.replica_group, self.num_replica_groups = int(group), int(groups)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ValueError(f"{type(self).__name__}: give replica_group= and num_replica_groups= (or set "
                             f"${GROUP_ENV} and ${GROUPS_ENV}) as ints, not {group!r} and {groups!r}.") from None
        if not 0 <= self.replica_group < self.num_replica_groups:
            raise ValueError(f"{type(self).__name__}(replica_group={self.replica_group}, num_replica_groups="
                             f"{self.num_replica_groups}): give 0 <= replica_group < num_replica_groups.")
        if not 1 <= self._min_replica_groups <= self.num_replica_groups:
            raise ValueError(f"{type(self).__name__}(min_replica_groups={self._min_replica_groups}): give 1 to "
                             f"num_replica_groups ({self.num_replica_groups}).")
        self.min_replica_groups = self._min_replica_groups

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """This group's share, for a ``DistributedSampler`` the module builds itself: the groups
        are the replicas (each process is a world of one)."""
        return {"num_replicas": self.num_replica_groups, "rank": self.replica_group}

    # ---- the environment --------------------------------------------------------------------
    def setup_environment(self) -> None:
        super().setup_environment()
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's own log: a line per quorum and commit at "info"
        try:
            from torchft.process_group import ProcessGroupGloo
        except ImportError:
            raise ImportError("strategy='native_ft' needs torchft: pip install 'xtrainer[ft]' (torchft 0.2, "
                              "torch 2.7 or newer).") from None
        logging.getLogger("torchft").setLevel(logging.WARNING)  # a line per quorum otherwise
        # The group's own store (one process: the manager's server and its client meet in it).
        self._store = dist.TCPStore(self.hostname, 0, is_master=True, wait_for_workers=False)
        self._pg = ProcessGroupGloo(timeout=timedelta(seconds=self.timeout_seconds))

    def join_live_peers(self, snapshot: Callable[[], dict[str, Any]],
                        checkpoint: dict[str, Any] | None) -> dict[str, Any] | None:
        """Join the groups training under the lighthouse: take the quorum of this group's first
        step; where a peer is ahead (or, at the job's first start, for every group but group 0),
        receive its state. ``snapshot()`` is what this group serves a peer that heals from it
        later; ``checkpoint`` the one this fit resumes from, if any (its step is this group's).
        Returns the peer's checkpoint to continue from, or None."""
        from torchft.manager import Manager

        self._snapshot = snapshot
        timeout = timedelta(seconds=self.timeout_seconds)
        try:
            self._manager = Manager(
                pg=self._pg, load_state_dict=self._load_peer_state, state_dict=self._serve_state,
                min_replica_size=self.min_replica_groups, use_async_quorum=False, timeout=timeout,
                quorum_timeout=timedelta(seconds=self.quorum_timeout_seconds),
                connect_timeout=timedelta(seconds=self.connect_timeout_seconds), rank=0, world_size=1,
                store_addr=self.hostname, store_port=self._store.port, lighthouse_addr=self.lighthouse,
                hostname=self.hostname, replica_id=f"xtrainer_group_{self.replica_group}",
                heartbeat_interval=timedelta(milliseconds=self.heartbeat_ms), init_sync=True)
        except Exception as err:  # torchft raises its RPC errors as plain exceptions
            raise self._lost(err) from None
        if checkpoint is not None:  # a resumed job: its groups are at the step their checkpoints hold
            self._manager.load_state_dict({"step": int(checkpoint["global_step"]), "batches_committed": 0})
        self._joining = True  # a peer's state now is the fit's to restore (returned), not loaded here
        try:
            self._quorum()
        finally:
            self._joining = False
        self._quorum_due = False  # the quorum just taken is the first step's
        peer, self._peer_state = self._peer_state, None
        if peer is not None:
            self.healed_at = int(peer["global_step"])
            loops = peer["loops"]
            if self.healed_at == 0 and loops["epoch"] == 0 and loops["batches_in_epoch"] == 0 and loops["epoch_finished"]:
                # the job's first start: a peer that has not begun its fit is at the start of the
                # first epoch (not the end of one before it, as a fit's state reads until it begins)
                peer = {**peer, "loops": {**loops, "epoch_finished": False}}
        self._step_seen = int((peer or checkpoint or {}).get("global_step", 0))
        return peer

    def step_starts(self) -> None:
        """Before each training batch that begins a step (the first of its micro-batches): the
        step's quorum (the first step's was taken as the group joined). Taken before the forward, so that a peer that dies anywhere in the step (its
        forward, its backward, its all-reduce) is one the survivors wait for in the all-reduce,
        and see fail; and between two batches, where the fit's state is what a checkpoint saved
        at a batch's end holds, which is what a healing peer is served."""
        if self._quorum_due:
            self._quorum_due = False
            self._quorum()

    def _quorum(self) -> None:
        """The quorum of the coming step (a round trip to the lighthouse, a host sync), taken as
        the group joins and before every later step. A group that missed a commit its peers
        made heals here, between two steps: the peer's module and optimizer state (the loop's
        position is the same: every group of a quorum ran the same steps)."""
        try:
            self._manager.start_quorum()
        except Exception as err:  # torchft raises its RPC errors as plain exceptions
            raise self._lost(err) from None
        if self._peer_state is not None and not self._joining:  # healed in the middle of the fit
            peer, self._peer_state = self._peer_state, None
            self.load_module_state_dict(self._wrapped, peer)
            if self._optimizer is not None:
                self._optimizer.load_state_dict(peer["optimizer_states"][0])
            self.healed_at = int(peer["global_step"])

    def _lost(self, err: Exception) -> LighthouseLost:
        cause = (str(err).splitlines() or [""])[0][:160]
        return LighthouseLost(
            f"native_ft: no quorum from the torchft lighthouse at {self.lighthouse} within "
            f"{self.quorum_timeout_seconds:g} s ({type(err).__name__}: {cause}): is torchft_lighthouse running and "
            "reachable? Restart it, then restart the groups (they resume from their checkpoints).")

    def _serve_state(self) -> dict[str, Any]:
        """This group's fit as a checkpoint, for a peer that heals (torchft's quorum thread calls
        it while the training thread waits for that quorum)."""
        assert self._snapshot is not None
        state = self._snapshot()
        # The callbacks' states stay with their group: a checkpoint callback's list of files is
        # of this group's run folder, which the healed group must not prune.
        state.pop("callbacks", None)
        return _cloned(state)

    def _load_peer_state(self, state: dict[str, Any]) -> None:
        self._peer_state = state

    # ---- the module and the data ---------------------------------------------------------------
    def setup_module(self, module: nn.Module) -> nn.Module:
        self._wrapped = super().setup_module(module)
        return self._wrapped

    def setup_optimizers(self, module: nn.Module, configure: Callable[[], Any], manual: bool = False) -> Any:
        if manual:
            raise ValueError("strategy='native_ft' steps the optimizer only when the step is committed, which "
                             "manual optimization cannot tell it: use automatic optimization.")
        return super().setup_optimizers(module, configure, manual)

    def process_dataloader(self, loader: Any, distribute: bool = True) -> DeviceData:
        """This group's fixed shard of ``loader`` (see the module's data rule)."""
        owns_sampler = False
        if distribute and isinstance(loader, torch.utils.data.DataLoader):
            distributed = distribute_dataloader(loader, self.num_replica_groups, self.replica_group)
            owns_sampler, loader = distributed is not loader, distributed
        return DeviceData(loader, self._deliver, owns_sampler, replicas=self.num_replica_groups)

    # ---- the step --------------------------------------------------------------------------------
    def _reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """The gradients averaged over the groups of the step's quorum: one flat buffer, one
        all-reduce through the manager, which records a peer's failure instead of raising."""
        self._optimizer = optimizer
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        # Waits for the all-reduce (a host sync: the commit that follows must know whether it failed).
        self._manager.allreduce(flat).wait()
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def optimizer_step(self, optimizer: torch.optim.Optimizer,
                       before_step: Callable[[], None] | None = None) -> None:
        """Reduce, clip, and step only if every group of the quorum completed the step
        (``should_commit``: a round trip to this group's manager, a host sync)."""
        self._reduce_gradients(optimizer)
        if before_step is not None:
            before_step()
        step = self._step_seen
        self._step_seen += 1
        if self._manager.should_commit():
            optimizer_call(optimizer)
        else:
            self.uncommitted_steps.append(step)
        self._quorum_due = True

    # ---- the end ---------------------------------------------------------------------------------
    def teardown(self, wrapped: nn.Module, failed: bool = False) -> None:
        if self._manager is not None:
            self._manager.shutdown(wait=False)
            self._manager = None
        self._store = self._pg = None
        super().teardown(wrapped, failed)
