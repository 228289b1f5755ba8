"""Values logged with ``XModule.log``: kept on the device, read back to the host in batches.

Every logged value is stored as a device tensor; nothing here calls ``.item()``. A store keeps,
per name, the latest value (for per-step logging) and an epoch accumulator, both updated inside
the step's graph. The host reads them only when the Trainer asks (``read_step`` every
``log_every_n_steps``, ``read_epoch`` at the end of an epoch), each time in one batched transfer.
The same tensors are updated on every step, so the graph's outputs, and so its compilation, do
not change from one step to the next.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from xtrainer.strategies import shared_process


REDUCE_FXS = ("mean", "sum", "max", "min")
_REDUCE_CALLABLES = {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min", sum: "sum",
                     max: "max", min: "min"}
_IDENTITY = {"mean": 0.0, "sum": 0.0, "max": -math.inf, "min": math.inf}


@dataclass
class _Entry:
    on_step: bool
    on_epoch: bool
    prog_bar: bool
    sync_dist: bool
    reduce_fx: str
    logger: bool = True
    metric: Any = None  # a torchmetrics Metric logged by object: its compute() is the epoch value
    last: torch.Tensor | None = None
    total: torch.Tensor | None = None
    weight: float = 0.0  # host-side: sum of batch sizes (mean) or number of values


@dataclass
class Results:
    """Logged values of one stage (``train``, ``validate``, ``test`` or ``predict``)."""

    stage: str
    default_on_step: bool
    entries: dict[str, _Entry] = field(default_factory=dict)
    # Of the batch being processed: inferred from ``batch`` (its first tensor's length) the first
    # time a value logged on_epoch with the mean reduction needs it, unless self.log gave one.
    batch_size: int | None = None
    batch: Any = None
    in_step: bool = False
    suffix: str = ""  # "/dataloader_idx_N" when an evaluation has several dataloaders
    loader: int = 0  # the index of the evaluation's dataloader being run
    # A name logged with add_dataloader_idx=False -> the evaluation's dataloaders it was logged in
    logged_in: dict[str, set[int]] = field(default_factory=dict)
    # Batch sizes and identities as device tensors, made once per value. A Python number in the
    # graph would be deduplicated with any other scalar of equal value (a learning rate, an
    # optimizer step count): a different graph, so a recompilation, whenever two coincide.
    _constants: dict[tuple[str, float], torch.Tensor] = field(default_factory=dict)

    def begin_batch(self, batch: Any) -> None:
        """Values logged from now on belong to ``batch`` (its size is read only if needed)."""
        self.batch, self.batch_size, self.in_step = batch, None, True

    def _batch_size(self) -> int:
        if self.batch_size is None:
            self.batch_size = batch_size(self.batch, strict=True)
        return self.batch_size

    def log(self, name: str, value: Any, on_step: bool | None, on_epoch: bool | None,
            prog_bar: bool, sync_dist: bool, reduce_fx: Any, batch_size: int | None, logger: bool = True,
            add_dataloader_idx: bool = True) -> None:
        if (type(value) is torch.Tensor and self.in_step and self.default_on_step and self.stage == "train"
                and (on_step is None or on_step) and not on_epoch and reduce_fx == "mean"):
            # A training step's value logged per step only, the call of nearly every step: only the
            # latest value is kept, so once its entry exists the value's own check is all it needs.
            entry = self.entries.get(name)
            if entry is not None and value.numel() == 1:
                entry.last = _scalar(value)
                return
        if not isinstance(value, torch.Tensor):
            if _is_metric(value):
                self._log_metric(name, value, on_step, on_epoch, prog_bar, logger, add_dataloader_idx)
                return
            if not isinstance(value, numbers.Real):  # Python's and numpy's numbers, bools (as 0 and 1), as Lightning
                raise TypeError(f"self.log({name!r}, ...) takes a scalar tensor or a number, "
                                f"not {type(value).__name__}.")
            value = torch.tensor(float(value))
        reduce_fx = _REDUCE_CALLABLES.get(reduce_fx, reduce_fx) if not isinstance(reduce_fx, str) else reduce_fx
        if reduce_fx not in REDUCE_FXS:
            raise ValueError(f"self.log({name!r}, reduce_fx={reduce_fx!r}): use one of {REDUCE_FXS} "
                             "(or torch.mean, torch.sum, torch.max, torch.min).")
        if value.numel() != 1:
            raise ValueError(f"self.log({name!r}, ...) takes a scalar, got a tensor of shape "
                             f"{tuple(value.shape)}; reduce it (e.g. .mean()) first.")
        on_step = self.default_on_step if on_step is None else on_step
        if self.stage != "train":
            # Evaluation values are per epoch (per dataloader). One asked for per step and per
            # epoch is named x_epoch (and x in callback_metrics), as in Lightning; one asked for
            # per step alone keeps its name. Per-batch values are not published: reading them
            # would sync the host in every evaluation batch.
            on_step = on_step and on_epoch is not False
            on_epoch = True
        on_epoch = (not self.default_on_step) if on_epoch is None else on_epoch
        if not self.in_step:
            on_step, on_epoch = False, True  # logged from an epoch hook: an epoch-level value
        if not (on_step or on_epoch):
            raise ValueError(f"self.log({name!r}, on_step=False, on_epoch=False) logs nothing.")
        if add_dataloader_idx:
            name = name + self.suffix
        else:
            self.logged_in.setdefault(name, set()).add(self.loader)
        entry = self.entries.get(name)
        if entry is None:
            entry = self.entries[name] = _Entry(on_step, on_epoch, prog_bar, sync_dist, reduce_fx, logger)
        value = _scalar(value)
        if on_step:
            entry.last = value
        if on_epoch:
            weight = 1
            if reduce_fx == "mean":  # weighted by the batch's size (one value of an epoch hook: by 1)
                weight = batch_size or (self._batch_size() if self.in_step else 1)
            weighted = value * self._constant(float(weight), value.device) if reduce_fx == "mean" else value
            if not self.in_step:
                entry.total, entry.weight = weighted, float(weight)
                return
            if entry.total is None:  # the epoch's first value: start from the reduction's identity
                entry.total = self._constant(_IDENTITY[reduce_fx], value.device)
            entry.total = _combine(reduce_fx, entry.total, weighted)
            entry.weight += weight

    def log_loss(self, name: str, loss: torch.Tensor) -> None:
        """The loop's own per-step value of the training loss (a detached 0-dim tensor): ``log``
        without the checks a user's value needs, once its entry exists."""
        entry = self.entries.get(name)
        if entry is None:
            self.log(name, loss, on_step=True, on_epoch=False, prog_bar=True, sync_dist=False, reduce_fx="mean",
                     batch_size=None)
        else:
            entry.last = loss if loss.dtype == torch.float32 else loss.float()

    def _log_metric(self, name: str, metric: Any, on_step: bool | None, on_epoch: bool | None, prog_bar: bool,
                    logger: bool, add_dataloader_idx: bool) -> None:
        """A torchmetrics ``Metric`` logged by object, with Lightning's meaning: per step, the value
        its ``forward`` computed for this batch; per epoch, ``compute()`` over the epoch's updates
        (synced across replicas in the graph), after which the metric is reset."""
        on_step = self.default_on_step if on_step is None else on_step
        on_epoch = (not self.default_on_step) if on_epoch is None else on_epoch
        if self.stage != "train" or not self.in_step:
            on_step, on_epoch = False, True
        if add_dataloader_idx:
            name = name + self.suffix
        else:
            self.logged_in.setdefault(name, set()).add(self.loader)
        entry = self.entries.get(name)
        if entry is None:
            entry = self.entries[name] = _Entry(on_step, on_epoch, prog_bar, False, "mean", logger, metric)
        if on_step:
            # Its forward's value of this batch. None after update() alone (or a reset): nothing is
            # logged for the step, as in Lightning; the epoch's value is computed all the same.
            value = getattr(metric, "_forward_cache", None)
            if isinstance(value, torch.Tensor) and value.numel() != 1:
                raise ValueError(f"self.log({name!r}, metric, on_step=True): its forward gave a tensor of shape "
                                 f"{tuple(value.shape)}; self.log takes metrics whose values are scalars.")
            entry.last = _scalar(value) if isinstance(value, torch.Tensor) else None

    def _constant(self, number: float, device: torch.device) -> torch.Tensor:
        """``number`` as device data, uploaded once. Starting each epoch from a data tensor (not
        from the first value) keeps the first step of every epoch the same graph as the others.
        Shape (1,), not (): torch_xla turns a 0-dim 0.0 or 1.0 into a constant of the graph."""
        key = (str(device), number)
        if key not in self._constants:
            self._constants[key] = torch.tensor([number]).to(device)
        return self._constants[key]

    # ---- reading (host syncs happen in the callers' to_cpu) ---------------------------------
    def step_tensors(self, reduce: Callable[[torch.Tensor, str], torch.Tensor], world_size: int,
                     only: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Latest per-step values, named ``x`` or ``x_step`` (if also logged per epoch);
        ``only``: of these entries alone."""
        out = {}
        for name, entry in (self.entries.items() if only is None else ((n, self.entries[n]) for n in only)):
            if entry.on_step and entry.last is not None:
                value = entry.last
                if entry.sync_dist and world_size > 1:
                    value = reduce(value, "sum") / world_size
                out[_step_name(name, entry)] = value
        return out

    def step_tensors_names(self) -> list[str]:
        """The names ``step_tensors`` gives its values."""
        return [_step_name(name, entry) for name, entry in self.entries.items()
                if entry.on_step and entry.last is not None]

    def epoch_tensors(self, reduce: Callable[[torch.Tensor, str], torch.Tensor], world_size: int,
                      gather: Callable[[torch.Tensor], torch.Tensor] | None = None, reset: bool = True,
                      metrics: bool = True, only: set[str] | None = None) -> dict[str, torch.Tensor]:
        """Epoch values, named ``x`` or ``x_epoch`` (if also logged per step). Metrics logged by
        object are computed (their states gathered from every replica with ``gather``) and, with
        ``reset``, reset, as is every metric logged per step only (as Lightning resets every metric
        logged in an epoch at its end); without ``metrics``, left out. ``only``: of these names alone."""
        out = {}
        for name, entry in self.entries.items():
            if only is not None and name not in only:
                continue
            if entry.metric is not None:
                if entry.on_epoch and metrics:
                    value = _compute_metric(entry.metric, world_size, gather, reset)
                    out[name + "_epoch" if entry.on_step else name] = value.detach().float().reshape(())
                elif reset and metrics:
                    entry.metric.reset()  # its per-step values were its forward's; the next epoch starts afresh
                continue
            if not entry.on_epoch or entry.total is None:
                continue
            total, weight = entry.total, entry.weight
            if entry.sync_dist and world_size > 1:
                total = reduce(total, "sum" if entry.reduce_fx in ("mean", "sum") else entry.reduce_fx)
                weight *= world_size  # every replica sees the same number of batches
            value = total / weight if entry.reduce_fx == "mean" else total
            out[name + "_epoch" if entry.on_step else name] = value.reshape(())
        return out

    def plain_names(self, values: dict[str, Any]) -> dict[str, Any]:
        """Lightning's plain names in ``callback_metrics`` for values logged both per step and per
        epoch: ``x`` is the latest of ``x_step`` and ``x_epoch`` in ``values`` (the epoch's where
        both are), so that ``monitor="x"`` finds it. Loggers and the progress bar keep the suffixes."""
        out = {}
        for name, entry in self.entries.items():
            if entry.on_step and entry.on_epoch:
                for key in (name + "_step", name + "_epoch"):
                    if key in values:
                        out[name] = values[key]
        return out

    def prog_bar_names(self) -> set[str]:
        names = set()
        for name, entry in self.entries.items():
            if entry.prog_bar:
                names.update({name, name + "_step", name + "_epoch"})
        return names

    def hidden_from_loggers(self) -> set[str]:
        """Names logged with ``logger=False``."""
        return {variant for name, entry in self.entries.items() if not entry.logger
                for variant in (name, name + "_step", name + "_epoch")}

    def state_dict(self, to_cpu: Callable[[Any], Any]) -> dict[str, Any]:
        """The epoch accumulators so far (on the host, by ``to_cpu``, the strategy's: a host sync,
        as a checkpoint is), so that a run resumed inside an epoch reports values over the whole epoch."""
        totals = {name: entry.total for name, entry in self.entries.items()
                  if entry.metric is None and entry.on_epoch and entry.total is not None}
        host = to_cpu(totals) if totals else {}  # host sync: the checkpoint's copy
        return {name: {"total": host[name], "weight": entry.weight, "on_step": entry.on_step,
                       "prog_bar": entry.prog_bar, "sync_dist": entry.sync_dist, "reduce_fx": entry.reduce_fx,
                       "logger": entry.logger}
                for name, entry in self.entries.items() if name in host}

    def load_state_dict(self, state: dict[str, Any] | None, device: torch.device) -> None:
        for name, saved in (state or {}).items():
            if saved.get("reduce_fx") not in REDUCE_FXS or not isinstance(saved.get("total"), torch.Tensor):
                continue  # not of this format: the epoch's values start afresh
            entry = self.entries[name] = _Entry(bool(saved["on_step"]), True, bool(saved["prog_bar"]),
                                                bool(saved["sync_dist"]), saved["reduce_fx"], bool(saved["logger"]))
            entry.total, entry.weight = saved["total"].to(device), float(saved["weight"])

    def reset_epoch(self) -> None:
        self.batch = None  # not kept alive past its epoch
        for entry in self.entries.values():
            entry.total, entry.weight = None, 0.0


def _step_name(name: str, entry: _Entry) -> str:
    """A per-step value's published name: ``x``, or ``x_step`` if also logged per epoch."""
    return name + "_step" if entry.on_epoch else name


def _scalar(value: torch.Tensor) -> torch.Tensor:
    """A logged one-element tensor as it is kept: detached, 0-dim, float32."""
    if value.requires_grad:  # the loss a step logs; the Trainer's own copy is detached already
        value = value.detach()
    if value.dim():
        value = value.reshape(())
    return value if value.dtype == torch.float32 else value.float()


def _holds_metrics(metric: Any) -> bool:
    children = metric.modules() if isinstance(metric, torch.nn.Module) else ()
    return any(child is not metric and _is_metric(child) for child in children)


def _is_metric(value: Any) -> bool:
    """A torchmetrics ``Metric`` (told by its methods: torchmetrics need not be installed)."""
    return not isinstance(value, torch.Tensor) and all(
        callable(getattr(value, name, None)) for name in ("update", "compute", "reset", "sync"))


def _compute_metric(metric: Any, world_size: int, gather: Callable[[torch.Tensor], torch.Tensor] | None,
                    reset: bool = True) -> torch.Tensor:
    """``metric.compute()``, its states synced across replicas by ``gather`` (an all-gather in the
    graph: torchmetrics' own sync would go through torch.distributed, which xla_native has not).

    The states are gathered first, and the computation then runs as the process lets one replica
    compute alone (``SharedProcess.computing_alone``): a compute may run the graph from C++ (a
    boolean-mask index), which replica threads of one process must not do at once. A metric that
    holds other metrics (torchmetrics' arithmetic of metrics) syncs inside its own compute."""
    sync_fn = lambda tensor, group=None: list(gather(tensor).unbind(0))  # noqa: E731
    original = getattr(metric.compute, "__wrapped__", None)  # torchmetrics' compute, without its sync
    if world_size == 1 or gather is None:
        value = metric.compute()
    elif original is not None and not _holds_metrics(metric):
        syncs = getattr(metric, "sync_on_compute", True)  # False: each replica's own value, as in torchmetrics
        if syncs:
            metric.sync(dist_sync_fn=sync_fn, distributed_available=lambda: True)
        try:
            with shared_process.current().computing_alone():
                value = original()
        finally:
            if syncs:
                metric.unsync()
    else:
        saved = metric.dist_sync_fn, metric.distributed_available_fn
        metric.dist_sync_fn, metric.distributed_available_fn = sync_fn, lambda: True
        try:
            value = metric.compute()
        finally:
            metric.dist_sync_fn, metric.distributed_available_fn = saved
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ValueError(f"A logged {type(metric).__name__} computed a value of type {type(value).__name__}; "
                         "self.log takes metrics whose compute() gives a scalar.")
    if reset:
        metric.reset()
    return value


def _combine(reduce_fx: str, total: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if reduce_fx in ("mean", "sum"):
        return total + value
    if reduce_fx == "max":
        return torch.maximum(total, value)
    return torch.minimum(total, value)


def epoch_results_of_replica(saved: Any, rank: int, world_size: int) -> dict[str, Any] | None:
    """Replica ``rank``'s epoch accumulators from a checkpoint's ``epoch_results`` (one state per
    saving replica). Saved by as many replicas: its own. By another number: each entry's totals of
    every saving replica combined and dealt out evenly, so that what the replicas reduce at the
    epoch's end is what the saving replicas held: a sum or a weighted mean split into equal shares
    (its totals and weights divided by ``world_size``), a max or min given to each. An entry logged
    without ``sync_dist`` is each replica's own value, which a change of replicas leaves without
    an exact meaning: it goes on from the saving replicas' average share. None: nothing saved."""
    if not isinstance(saved, list) or not saved or not all(isinstance(state, dict) for state in saved):
        return None
    if len(saved) == world_size:
        return saved[rank]
    merged: dict[str, Any] = {}
    for name in saved[0]:
        parts = [state.get(name) for state in saved]
        if not all(isinstance(p, dict) and isinstance(p.get("total"), torch.Tensor) for p in parts) \
                or len({p.get("reduce_fx") for p in parts}) != 1 or parts[0]["reduce_fx"] not in REDUCE_FXS:
            continue  # not of this format, or not logged alike by every replica: starts afresh
        fx = parts[0]["reduce_fx"]
        totals = torch.stack([p["total"].reshape(()) for p in parts])
        if fx in ("sum", "mean"):
            total = totals.sum() / world_size
            weight = sum(float(p["weight"]) for p in parts) / world_size
        else:
            total = totals.max() if fx == "max" else totals.min()
            weight = max(float(p["weight"]) for p in parts)
        merged[name] = {**parts[0], "total": total, "weight": weight}
    return merged


def to_floats(tensors: dict[str, torch.Tensor], to_cpu: Callable[[Any], Any]) -> dict[str, float]:
    """Device scalars to Python floats in one batched transfer (``to_cpu``: the strategy's). Syncs
    the host. Tensors already in host memory (the CPU's) are read as they are."""
    on_device = {name: value for name, value in tensors.items() if value.device.type != "cpu"}
    if on_device:
        tensors = {**tensors, **to_cpu(on_device)}  # host sync: one transfer for every value
    return {name: float(value) for name, value in tensors.items()}


_NO_BATCH_SIZE = ("Could not infer the batch size from the batch ({}) to weight an epoch mean; pass it as "
                  "self.log(..., batch_size=N), or simplify the batch's structure.")
_warned_ambiguous: set[int] = set()


def _sizes(batch: Any):
    """Lengths met walking the batch: dim 0 of each tensor (1 for a 0-dim one), None for each leaf
    that is not a tensor (a string, a number, any other object). Shape metadata only: no host sync."""
    if isinstance(batch, torch.Tensor):
        yield int(batch.shape[0]) if batch.dim() else 1
    elif type(batch) in (tuple, list):  # the common batches first, ahead of the checks by protocol
        for item in batch:
            yield from _sizes(item)
    elif type(batch) is dict:
        for value in batch.values():
            yield from _sizes(value)
    elif isinstance(batch, (str, bytes)) or hasattr(batch, "__array__"):
        yield None  # a leaf: a NumPy array is not walked element by element either
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _sizes(value)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for f in dataclasses.fields(batch):
            yield from _sizes(getattr(batch, f.name))
    elif isinstance(batch, Iterable) and not isinstance(batch, Iterator):  # an iterator would be used up
        for item in batch:
            yield from _sizes(item)
    else:
        yield None


def batch_size(batch: Any, strict: bool = False) -> int:
    """The batch's size as Lightning infers it: the length (dim 0) of the first tensor found
    walking the batch (mappings by value, sequences, dataclasses), so that ``(texts, labels)``
    counts ``len(labels)``. When anything met after it (another tensor's length, or a leaf that is
    not a tensor) disagrees, the batch is ambiguous: the first length is kept, with a warning once.
    Without any tensor: 1, or with ``strict`` (a size is needed to weight a mean) a ValueError.
    Reads shapes only: no host sync."""
    if not strict:  # the first tensor's length is the answer: the usual batches take the short way
        first = batch[0] if type(batch) in (tuple, list) and batch else batch
        if isinstance(first, torch.Tensor):
            return int(first.shape[0]) if first.dim() else 1
    size = None
    ambiguous = False
    try:
        for found in _sizes(batch):
            if size is None:
                size = found
                if size is not None and not strict:
                    break  # no warning to give: the rest need not be walked
            elif found != size:
                ambiguous = True
                break
    except RecursionError:
        raise ValueError(_NO_BATCH_SIZE.format("it nests too deeply")) from None
    if size is None:
        if strict:
            raise ValueError(_NO_BATCH_SIZE.format("no tensor in it"))
        return 1
    if ambiguous and strict and size not in _warned_ambiguous:
        _warned_ambiguous.add(size)
        warnings.warn(f"The batch size inferred from an ambiguous batch (its parts have different lengths, or "
                      f"parts that are not tensors) is {size}, the length of its first tensor; to log epoch "
                      "means weighted otherwise, pass self.log(..., batch_size=N).", UserWarning,
                      stacklevel=5)  # the self.log call in the user's step
    return size
