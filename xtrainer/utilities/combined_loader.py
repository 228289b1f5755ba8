"""Lightning's ``CombinedLoader``: several iterables read together, each step's batch a
collection of the same shape (a dict of batches for a dict of loaders, a list for a list).

Modes, with Lightning's meaning:

- ``"min_size"`` (the default): until the shortest iterable runs out;
- ``"max_size_cycle"``: until the longest runs out, the others started again as they run out
  (what ``fit`` does with a dict or a list of training loaders);
- ``"max_size"``: until the longest runs out, ``None`` in place of those that ran out;
- ``"sequential"``: one iterable after the other, each batch on its own (what ``validate``,
  ``test`` and ``predict`` do with several loaders).

Iterating one yields ``(batch, batch_idx, dataloader_idx)``, as Lightning's does; the Trainer
reads the loaders inside itself (each with the sampler and the device delivery the strategy
gives a loader, ``xtrainer.strategies.data.CombinedData``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator

MODES = ("min_size", "max_size_cycle", "max_size", "sequential")


def flatten(tree: Any) -> tuple[list[Any], Any]:
    """The leaves of a nest of dicts, lists and tuples (the iterables), and its shape (``spec``)."""
    if isinstance(tree, Mapping):
        leaves, specs = [], []
        for value in tree.values():
            sub, spec = flatten(value)
            leaves += sub
            specs.append((spec, len(sub)))
        return leaves, (type(tree), list(tree.keys()), specs)
    if isinstance(tree, (list, tuple)):
        leaves, specs = [], []
        for value in tree:
            sub, spec = flatten(value)
            leaves += sub
            specs.append((spec, len(sub)))
        return leaves, (type(tree), None, specs)
    return [tree], None


def unflatten(leaves: list[Any], spec: Any) -> Any:
    """``leaves`` put back in the shape ``flatten`` found (``spec``)."""
    if spec is None:
        return leaves[0]
    kind, keys, specs = spec
    parts, at = [], 0
    for sub, count in specs:
        parts.append(unflatten(leaves[at:at + count], sub))
        at += count
    if keys is not None:
        return kind(zip(keys, parts)) if kind is not dict else dict(zip(keys, parts))
    return kind(parts) if kind in (list, tuple) else kind(*parts)


def sized(iterable: Any) -> float:
    """``len(iterable)``; infinite where it has none."""
    try:
        return len(iterable)
    except (TypeError, NotImplementedError):
        return math.inf


def combined_length(lengths: list[float], mode: str) -> float:
    """The batches of one pass in ``mode`` over iterables of ``lengths``."""
    if not lengths:
        return 0
    if mode == "min_size":
        return min(lengths)
    if mode == "sequential":
        return sum(lengths)
    return max(lengths)


def rows(start: Callable[[int, int, int], Iterator[Any]], lengths: list[float], mode: str, skip: int = 0
         ) -> Iterator[list[Any]]:
    """One list per step of ``mode`` (not ``"sequential"``), an item of each iterable: the k-th
    iterable's items come from ``start(k, cycle, position)``, an iterator from ``position`` in
    its ``cycle``-th pass (``max_size_cycle`` starts an iterable again when it runs out). From
    step ``skip`` on; a ``skip`` needs every length known."""
    count = len(lengths)
    if skip and any(math.isinf(n) for n in lengths):
        raise ValueError("Cannot start combined iterables without lengths part way.")
    cycling = [mode == "max_size_cycle" and 0 < n < math.inf for n in lengths]  # passes known by length
    cycles = [int(skip // n) if cycles_known else 0 for n, cycles_known in zip(lengths, cycling)]
    done = [mode == "max_size_cycle" and skip >= n for n in lengths]  # passed through once already
    iterators: list[Iterator[Any] | None] = []
    for k, n in enumerate(lengths):
        position = int(skip % n) if cycling[k] else skip
        iterators.append(start(k, cycles[k], position) if mode != "max_size" or position < n else None)
    while True:
        row = [None] * count
        for k in range(count):
            iterator = iterators[k]
            if iterator is None:  # max_size: ran out earlier
                continue
            try:
                row[k] = next(iterator)
                continue
            except StopIteration:
                pass
            if mode == "min_size":
                return
            done[k], iterators[k] = True, None
            if mode == "max_size":
                if all(it is None for it in iterators):
                    return
                continue
            if all(done):  # max_size_cycle: every iterable went through once
                return
            cycles[k] += 1
            iterators[k] = start(k, cycles[k], 0)
            try:
                row[k] = next(iterators[k])
            except StopIteration:
                raise ValueError(f"The combined loaders' iterable {k} is empty: it has no batch to cycle.") from None
        yield row


class CombinedLoader:
    """Several iterables (a dict, list or tuple of loaders, nested as you like) read together
    in ``mode`` (module docstring). ``len()`` is the number of steps of one pass;
    ``flattened`` the iterables in order."""

    def __init__(self, iterables: Any, mode: str = "min_size") -> None:
        if mode not in MODES:
            raise ValueError(f"CombinedLoader(mode={mode!r}): use one of {MODES}.")
        self._iterables = iterables
        self._mode = mode
        self._flattened, self._spec = flatten(iterables)
        self._iterator: Iterator[tuple[Any, int, int]] | None = None

    @property
    def iterables(self) -> Any:
        return self._iterables

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def flattened(self) -> list[Any]:
        return list(self._flattened)

    @flattened.setter
    def flattened(self, flattened: list[Any]) -> None:
        if len(flattened) != len(self._flattened):
            raise ValueError(f"CombinedLoader.flattened: {len(flattened)} iterables given for "
                             f"{len(self._flattened)}.")
        self._flattened = list(flattened)
        self._iterables = unflatten(self._flattened, self._spec)

    def _lengths(self) -> list[float]:
        return [sized(it) for it in self._flattened]

    def __len__(self) -> int:
        length = combined_length(self._lengths(), self._mode)
        if math.isinf(length):
            raise TypeError("This CombinedLoader has no length: one of its iterables has none.")
        return int(length)

    def __iter__(self) -> CombinedLoader:
        self._iterator = self._steps()
        return self

    def __next__(self) -> tuple[Any, int, int]:
        if self._iterator is None:
            iter(self)
        return next(self._iterator)  # type: ignore[arg-type]

    def _steps(self) -> Iterator[tuple[Any, int, int]]:
        if self._mode == "sequential":
            for index, iterable in enumerate(self._flattened):
                for batch_idx, batch in enumerate(iterable):
                    yield batch, batch_idx, index
            return
        # reading in this mode's steps; cycle and position are where a fresh iterator starts
        for batch_idx, row in enumerate(rows(lambda k, cycle, position: iter(self._flattened[k]),
                                             self._lengths(), self._mode)):
            yield unflatten(row, self._spec), batch_idx, 0

    def reset(self) -> None:
        self._iterator = None

    def combine(self, row: list[Any]) -> Any:
        """A step's items (one per iterable, in ``flattened`` order) in the iterables' shape."""
        return unflatten(row, self._spec)
