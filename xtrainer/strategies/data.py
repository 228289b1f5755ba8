"""How batches reach a replica: its share of a loader, delivered on the device.

``Strategy.process_dataloader`` gives each replica a ``DeviceData``; ``distribute_dataloader``
puts a ``DistributedSampler`` in a plain loader, ``shuffled_dataloader`` turns shuffling on (a
training loader of several replicas, as Lightning's sampler shuffles it) and
``sequential_dataloader`` off (``overfit_batches``).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from typing import Any, Callable, Iterable, Iterator

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from xtrainer.utilities.combined_loader import combined_length, rows, sized


class DeviceData:
    """A data loader whose batches arrive on the device, re-seeded at every epoch.

    A sampler the strategy put in (``owns_sampler``) shuffles with the run's seed and the epoch
    only, so a resumed run sees the same order as the original one. Any other loader draws its
    order (its sampler's, its workers' seeds, an iterable dataset's shuffle at the start of an
    epoch) from generators of the epoch's own: ones seeded with the run's seed and the epoch where
    the loader has none, or the user's, whose state at the epoch's start a checkpoint keeps
    (``state_dict``). Either way a run resumed inside an epoch draws that epoch's order again.

    A loader without a generator of its own would draw its workers' base seed from torch's
    global generator each time an epoch's iterator starts (a ``DataLoader`` does so even without
    workers): on the CPU that is the generator of the step's random ops (dropout), which a
    checkpoint saves after that draw, so the resumed epoch's start would draw again and shift
    them. Every loader therefore gets a generator of the epoch's own where it has none.

    ``on_device(loader, start=0)`` delivers a host loader's batches on the device (the strategy's
    ``batches_on_device``).
    """

    def __init__(self, loader: Iterable, on_device: Callable[..., Iterable], owns_sampler: bool = False,
                 replicas: int = 1) -> None:
        self.loader, self.owns_sampler, self.replicas = loader, owns_sampler, replicas
        if isinstance(loader, DataLoader) and loader.num_workers > 0 \
                and not isinstance(loader.worker_init_fn, _WorkerOfThisRun):
            loader.worker_init_fn = _WorkerOfThisRun(loader.worker_init_fn)
        self._on_device = on_device
        self._device_loader = on_device(loader)
        self._ours: set[int] = set()  # ids of the generators this object put in
        self._epoch_start: dict[str, Any] = {}  # the user's generators' states when the epoch began
        self._epoch_seed: int | None = None
        self._seen: SeenBatches | None = None  # where each batch's sample indices are noted (note_batch_indices)

    def set_epoch(self, epoch: int, seed: int | None = None) -> None:
        sampler = getattr(self.loader, "sampler", None)
        if self.owns_sampler and seed is not None:
            sampler.seed = seed
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        batch_sampler = getattr(self.loader, "batch_sampler", None)
        if hasattr(getattr(batch_sampler, "sampler", None), "set_epoch"):
            batch_sampler.sampler.set_epoch(epoch)
        if seed is not None:
            self._epoch_seed = _mix(seed, epoch)
            self._seed_generators(self._epoch_seed)

    def _generator_holders(self) -> dict[str, Any]:
        batch_sampler = getattr(self.loader, "batch_sampler", None)
        holders = {"loader": self.loader if isinstance(self.loader, DataLoader) else None,
                   "sampler": getattr(self.loader, "sampler", None),
                   "batch_sampler.sampler": getattr(batch_sampler, "sampler", None)}
        return {name: obj for name, obj in holders.items() if obj is not None and hasattr(obj, "generator")}

    def _seed_generators(self, seed: int) -> None:
        self._epoch_start = {}
        for i, (name, holder) in enumerate(self._generator_holders().items()):
            generator = holder.generator
            if generator is None or id(generator) in self._ours:
                generator = torch.Generator().manual_seed(seed + i)
                self._ours.add(id(generator))
                holder.generator = generator
            elif isinstance(generator, torch.Generator):
                self._epoch_start[name] = generator.get_state()

    def state_dict(self) -> dict[str, Any]:
        """What a run resumed inside this epoch needs to draw the epoch's order again (and its
        ``layout``, to tell whether a run of another world size continues it exactly)."""
        return {"generators": dict(self._epoch_start), "layout": self.layout()}

    def layout(self) -> dict[str, Any] | None:
        """How the epoch's global batches are made, when it does not depend on the world size's
        split: a sampler the strategy put in (a ``DistributedSampler`` re-seeded with the run's
        seed and the epoch) deals out one order of its ``samples`` (the dataset, padded to a
        multiple of the world size) to the replicas in turn, so the k-th global batch is the
        k-th run of ``global_batch`` samples of that order on any number of replicas; a plain
        sequential loader of one replica is the same order unshuffled. Equal layouts: the same
        batches, whatever the world size. None: the order is the loader's own, not known here."""
        loader = self.loader
        if not isinstance(loader, DataLoader) or type(loader.batch_sampler) is not BatchSampler:
            return None
        sampler, batch_size = loader.sampler, loader.batch_sampler.batch_size
        if self.owns_sampler and isinstance(sampler, DistributedSampler) and not sampler.drop_last:
            return {"shuffle": bool(sampler.shuffle), "samples": int(sampler.total_size),
                    "global_batch": batch_size * sampler.num_replicas, "drop_last": loader.batch_sampler.drop_last}
        if type(sampler) is SequentialSampler and self.replicas == 1:  # one replica's plain loader
            return {"shuffle": False, "samples": len(sampler), "global_batch": batch_size,
                    "drop_last": loader.batch_sampler.drop_last}
        return None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """After ``set_epoch``: put the user's generators back to where this epoch began."""
        for name, holder in self._generator_holders().items():
            saved = (state or {}).get("generators", {}).get(name)
            if isinstance(saved, torch.Tensor) and isinstance(holder.generator, torch.Generator) \
                    and id(holder.generator) not in self._ours:
                holder.generator.set_state(saved)
                self._epoch_start[name] = saved

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        if self._seen is not None:  # a copy of the loader whose batch sampler notes what it draws
            return iter(self._on_device(_with_batch_sampler(self.loader, self._seen)))
        if self._primes():
            return (batch for _, batch in self.resume_at(0))
        return iter(self._device_loader)

    def note_batch_indices(self) -> SeenBatches | None:
        """From the next iteration on, note each batch's sample indices as the loader draws them
        (Lightning's ``batch_indices``, which prediction writers receive): ``seen`` of what this
        returns, one list per batch, started afresh at each iteration. The loader is not changed:
        each iteration reads a copy of it around its batch sampler, with its settings and its
        sampler as they are then. None where there is no batch sampler to note them at: an
        iterable dataset, a ``DataLoader`` subclass, or any other iterable."""
        if self._seen is None and _rebuildable(self.loader):
            self._seen = SeenBatches(self.loader.batch_sampler)
        return self._seen

    def _primes(self) -> bool:
        """An iterable dataset read in this process: its epoch's first draws (a shuffle when its
        iterator starts) come from torch's global generator, in the loader's thread."""
        return (self._epoch_seed is not None and isinstance(self.loader, DataLoader)
                and isinstance(self.loader.dataset, torch.utils.data.IterableDataset) and self.loader.num_workers == 0)

    def resume_at(self, skip: int) -> Iterable[tuple[int, Any]]:
        """``(batch_idx, batch)`` from batch ``skip`` on: resuming inside an epoch.

        A map-style ``DataLoader`` skips at its batch sampler, by index: the skipped batches are
        neither loaded nor sent, so resuming late in an epoch costs what resuming at its start
        does. Any other loader (an ``IterableDataset``, a custom iterable) has no index to skip to:
        its first ``skip`` batches are read on the host and dropped (not sent to the device).
        """
        if self._primes():
            loader: Iterable = _Primed(self.loader, skip, self._epoch_seed)
        elif skip == 0:
            return enumerate(self._device_loader)
        else:
            loader = _skipping_loader(self.loader, skip)
        device_loader = self._on_device(loader, start=skip)
        return enumerate(device_loader, start=skip)


class _WorkerOfThisRun:
    """A DataLoader worker's start (then the user's ``worker_init_fn``): it leaves SIGINT to the
    training process, which stops gracefully and shuts the workers down (a terminal's Ctrl-C
    reaches the whole process group); SIGTERM ends it (a forked worker would otherwise inherit the
    training process's graceful handler and never end when told to); and it ends within half a
    second of the training process, however that ends (SIGKILL included), instead of waiting for
    torch's own check."""

    def __init__(self, user_fn: Any) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        import os
        import signal
        import threading
        import time

        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        parent = os.getppid()

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(0)

        threading.Thread(target=watch, name="xtrainer-worker-parent-watch", daemon=True).start()
        if self.user_fn is not None:
            self.user_fn(worker_id)


def _mix(seed: int, epoch: int) -> int:
    """A generator seed for ``epoch`` of the run seeded with ``seed``."""
    return (seed * 1_000_003 + epoch * 7919 + 12345) % 2**62


class _Primed:
    """An iterable dataset's loader whose epoch is started in the thread that trains, under
    torch's global generator seeded for the epoch (and given back unchanged): whatever the dataset
    draws when its iterator starts is the same on every run of the epoch, resumed ones included.
    The first ``skip`` batches are read and dropped.

    The whole epoch is read in that thread (``read_in_calling_thread``: the device loader reads
    it between training steps, after their graph cut, not in a background thread), because such
    a generator may run the model on the device (a reinforcement-learning module playing its
    environment): there its graphs never mix with a step's, and compile once
    (``_xla.DataOnDevice``)."""

    read_in_calling_thread = True

    def __init__(self, loader: DataLoader, skip: int, seed: int) -> None:
        self.loader, self.skip, self.seed = loader, skip, seed

    def __iter__(self) -> Iterator[Any]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            batches = iter(self.loader)
            started = list(itertools.islice(batches, self.skip + 1))
        return itertools.chain(started[self.skip:], batches)


class SeenBatches:
    """A batch sampler that notes each batch's indices as the loader draws them (``seen``; with
    workers, the loader draws a few batches ahead of the one being used)."""

    def __init__(self, batch_sampler: Iterable[list[int]]) -> None:
        self.batch_sampler = batch_sampler
        self.seen: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        self.seen = []
        for indices in self.batch_sampler:
            self.seen.append([int(i) for i in indices])
            yield indices

    def __len__(self) -> int:
        return len(self.batch_sampler)  # type: ignore[arg-type]


class _SkipBatches:
    """A batch sampler without its first ``skip`` batches (their indices are drawn, and dropped)."""

    def __init__(self, batch_sampler: Iterable[list[int]], skip: int) -> None:
        self.batch_sampler, self.skip = batch_sampler, skip

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.batch_sampler), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip)  # type: ignore[arg-type]


class _DropFirst:
    """An iterable without its first ``skip`` items, read and dropped on the host."""

    def __init__(self, loader: Iterable, skip: int) -> None:
        self.loader, self.skip = loader, skip

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.loader), self.skip, None)


def _skipping_loader(loader: Iterable, skip: int) -> Iterable:
    if _rebuildable(loader):
        return _with_batch_sampler(loader, _SkipBatches(loader.batch_sampler, skip))
    return _DropFirst(loader, skip)


def _rebuildable(loader: Any) -> bool:
    """A plain ``DataLoader`` over a map-style dataset: one that can be made again with another
    batch sampler (``_with_batch_sampler``)."""
    return (type(loader) is DataLoader and loader.batch_sampler is not None
            and not isinstance(loader.dataset, torch.utils.data.IterableDataset))


def _loader_kwargs(loader: DataLoader) -> dict[str, Any]:
    """``loader``'s settings, as ``DataLoader`` takes them."""
    kwargs = {name: getattr(loader, name) for name in _DATALOADER_ARGS if hasattr(loader, name)}
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("prefetch_factor", None)
        kwargs.pop("persistent_workers", None)
    return kwargs


def _with_batch_sampler(loader: DataLoader, batch_sampler: Any) -> DataLoader:
    kwargs = _loader_kwargs(loader)
    for name in ("batch_size", "drop_last"):  # they belong to the batch sampler
        kwargs.pop(name, None)
    return DataLoader(loader.dataset, batch_sampler=batch_sampler, **kwargs)


_DATALOADER_ARGS = ("batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout",
                    "worker_init_fn", "multiprocessing_context", "generator", "prefetch_factor",
                    "persistent_workers")


def _plain_random(loader: DataLoader) -> bool:
    """A plain loader over a ``RandomSampler`` that a seeded ``DistributedSampler`` can stand in
    for exactly (same samples, an order that depends on the seed and the epoch only)."""
    sampler = loader.sampler
    return (type(loader) is DataLoader and type(loader.batch_sampler) is BatchSampler
            and type(sampler) is RandomSampler and not sampler.replacement
            and sampler._num_samples is None)  # private attribute: the num_samples argument


def distribute_dataloader(loader: DataLoader, num_replicas: int, rank: int) -> DataLoader:
    """``loader`` with its sampler replaced by a ``DistributedSampler`` for ``rank``.

    The new sampler keeps the loader's shuffle setting and is re-seeded each epoch by the
    Trainer (``set_epoch``). Its padding makes every replica see the same number of batches,
    so no replica waits at a collective for another that ran out of data. A loader over an
    ``IterableDataset`` is returned as it is: each replica reads the whole stream (Lightning's way).
    """
    if isinstance(loader.sampler, DistributedSampler):
        return loader
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        # As Lightning does: no sampler can split a stream, so every replica reads the dataset
        # as it is (an RL module plays an environment of its own on each replica).
        rank_zero_warn(f"An IterableDataset ({type(loader.dataset).__name__}) is read whole by each of the "
                       f"{num_replicas} replicas: split it by trainer.global_rank inside the dataset unless every "
                       "replica should read a stream of its own, and give every replica as many batches (a "
                       "replica that runs out first leaves the others waiting at a collective).")
        return loader
    if (type(loader) is not DataLoader or type(loader.batch_sampler) is not BatchSampler
            or type(loader.sampler) not in (SequentialSampler, RandomSampler)):
        raise TypeError(
            f"Cannot shard {type(loader).__name__} (sampler {type(loader.sampler).__name__}) across "
            f"{num_replicas} replicas automatically. Give it a torch.utils.data.DistributedSampler "
            f"with num_replicas={num_replicas} and rank=trainer.global_rank yourself."
        )
    shuffle = isinstance(loader.sampler, RandomSampler)
    return _with_sampler(loader, DistributedSampler(loader.dataset, num_replicas=num_replicas, rank=rank,
                                                    shuffle=shuffle))


def padded_samples(data: Any) -> tuple[int, int]:
    """(samples repeated, samples in the dataset) where the strategy put a ``DistributedSampler``
    in ``data``'s loader that pads the dataset to a multiple of the replicas; (0, 0) otherwise."""
    loader = getattr(data, "loader", None)
    sampler = getattr(loader, "sampler", None)
    if not getattr(data, "owns_sampler", False) or not isinstance(sampler, DistributedSampler) or sampler.drop_last:
        return 0, 0
    size = len(sampler.dataset)  # type: ignore[arg-type]
    return sampler.total_size - size, size


def shuffled_dataloader(loader: Any) -> Any:
    """A plain loader in order (``SequentialSampler``) as one that shuffles: the training loader
    of several replicas under the distributed sampler, whose ``DistributedSampler`` (put in by
    ``distribute_dataloader``) then shuffles, as Lightning's does for every training loader."""
    if type(loader) is DataLoader and type(loader.sampler) is SequentialSampler \
            and type(loader.batch_sampler) is BatchSampler:
        return _with_sampler(loader, RandomSampler(loader.dataset))
    return loader


def sequential_dataloader(loader: Any) -> Any:
    """``loader`` without shuffling (``overfit_batches``: the same first batches every epoch)."""
    if isinstance(loader, DataLoader) and type(loader) is DataLoader and isinstance(loader.sampler, RandomSampler) \
            and type(loader.batch_sampler) is BatchSampler:
        rank_zero_warn("overfit_batches: the training loader's shuffling is turned off, so every epoch sees the "
                       "same batches.")
        return _with_sampler(loader, SequentialSampler(loader.dataset))
    return loader


def _with_sampler(loader: DataLoader, sampler: Any) -> DataLoader:
    return DataLoader(loader.dataset, sampler=sampler, **_loader_kwargs(loader))


class CombinedData:
    """Several training loaders read together (a ``CombinedLoader``: ``fit`` with a dict or a list
    of loaders), each given to this replica as one loader is (``inner``: a ``DeviceData`` each,
    with its sampler and its delivery on the device). Each step's batch has the loaders' shape.

    In ``max_size_cycle`` a shorter loader starts again as it runs out; each of its passes in an
    epoch draws an order of its own, from the run's seed, the epoch, the loader's place and the
    pass, so that a run resumed inside an epoch reads every loader from where it was, in the
    same order, by index (as one loader does). A loader with a generator of its own is read on
    from that generator; resumed in a later pass than the checkpoint's, its order is not the
    saved run's, and a warning says so."""

    def __init__(self, combined: Any, inner: list[DeviceData],
                 rng_state_kept: Callable[[], Any] = contextlib.nullcontext) -> None:
        self.combined, self.inner, self._rng_state_kept = combined, inner, rng_state_kept
        self.mode = combined.mode
        self.loader = combined.combine([data.loader for data in inner])  # what trainer.train_dataloader shows
        self._epoch, self._seed = 0, None
        self._passes = [0] * len(inner)  # the pass each loader is in
        self._restored: dict[str, Any] | None = None  # a checkpoint's state, for each loader's first pass on resume
        self._restoring = [False] * len(inner)

    def _lengths(self) -> list[float]:
        return [sized(data) for data in self.inner]

    def __len__(self) -> int:
        length = combined_length(self._lengths(), self.mode)
        if math.isinf(length):
            raise TypeError("These combined loaders have no length: one of them has none.")
        return int(length)

    def set_epoch(self, epoch: int, seed: int | None = None) -> None:
        self._epoch, self._seed, self._restored = epoch, seed, None
        self._passes, self._restoring = [0] * len(self.inner), [False] * len(self.inner)
        for k, data in enumerate(self.inner):
            data.set_epoch(epoch, self._pass_seed(k, 0))

    def _pass_seed(self, k: int, cycle: int) -> int | None:
        return None if self._seed is None else _mix(_mix(self._seed, k + 1), cycle)

    def state_dict(self) -> dict[str, Any]:
        return {"combined": [data.state_dict() for data in self.inner], "passes": list(self._passes)}

    def layout(self) -> None:
        return None  # several loaders: the order of each replica's share is not worked out here

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """After ``set_epoch``: each loader's generators as they were at the start of its pass."""
        self._restored = state if isinstance(state, dict) and "combined" in state else None
        self._restoring = [True] * len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        return (batch for _, batch in self.resume_at(0))

    def _start(self, k: int, cycle: int, position: int) -> Iterator[Any]:
        data = self.inner[k]
        if cycle or self._passes[k]:  # a later pass, or the first one read again: its own order
            data.set_epoch(self._epoch, self._pass_seed(k, cycle))
        restored, self._restoring[k] = (self._restored if self._restoring[k] else None), False
        if restored is not None and len(restored["combined"]) == len(self.inner):
            saved_pass = restored["passes"][k] if k < len(restored.get("passes", ())) else 0
            if saved_pass == cycle:
                data.load_state_dict(restored["combined"][k])
            elif data.state_dict()["generators"]:
                rank_zero_warn(f"Resuming inside an epoch: training loader {k} of the combined loaders has a generator "
                               "of its own and was between two passes when the checkpoint was written, so the rest "
                               "of its pass is not the order the saved run would have drawn.")
        self._passes[k] = cycle
        return self._pass(data, position, sized(data))

    def _pass(self, data: DeviceData, position: int, length: float) -> Iterator[Any]:
        """One pass of a loader from ``position``. Where its length is known, its end is read
        (a device loader's last graph cut, which advances XLA's generator) leaving the
        generator as it was: a run resumed just after that end starts the next pass without
        reading it, and must draw the same random numbers."""
        iterator = iter(data.resume_at(position))
        for taken in itertools.count(position):
            if taken >= length:
                with self._rng_state_kept():
                    for _ in iterator:
                        pass
                return
            try:
                _, batch = next(iterator)
            except StopIteration:
                return
            yield batch

    def resume_at(self, skip: int) -> Iterable[tuple[int, Any]]:
        """``(batch_idx, batch)`` from step ``skip`` on, each loader from its place in its pass."""
        combine = self.combined.combine
        lengths = self._lengths()
        if skip and any(math.isinf(n) for n in lengths):  # no index to start at: read and drop
            return itertools.islice(enumerate(combine(row) for row in rows(self._start, lengths, self.mode)),
                                    skip, None)
        return enumerate((combine(row) for row in rows(self._start, lengths, self.mode, skip)), start=skip)
