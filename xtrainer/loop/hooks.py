"""Who implements each hook: ``Trainer._call`` calls only those.

Every hook of ``XModule`` and ``Callback`` is a no-op unless overridden, and a fit calls five of
them on every batch. Calling the module's and every callback's hook each time costs a lookup and
a call per object per hook for nothing; the table looks up once which of them override a hook
(in the class, or set on the instance) and keeps their bound methods. It is built again when the
module or the callbacks change (another list, or the same list with a callback added, removed or
replaced); a method set on a module or callback after a hook was first called in a run is not
seen. An object with its own ``__getattribute__`` is asked for the hook on every call.

The five hooks of every training batch are looked up once per batch (``HookTable.batch``): each
is None where nothing overrides it, so the loop skips it without a call. A callback added (or
replaced) during a batch is called from the next batch on.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

from xtrainer.callbacks.base import Callback
from xtrainer.module import XModule
from xtrainer.trainer_view import TrainerView


class BatchHooks(NamedTuple):
    """The hooks a training batch calls, each None where neither the module nor a callback
    overrides it, else one callable of the hook's arguments that calls them in order and returns
    the module's answer (as ``Trainer._call``)."""

    on_train_batch_start: Callable[..., Any] | None
    on_before_backward: Callable[..., Any] | None
    on_after_backward: Callable[..., Any] | None
    on_before_zero_grad: Callable[..., Any] | None
    on_train_batch_end: Callable[..., Any] | None


class HookTable:
    """Per hook: the module's method if it overrides ``XModule``'s, and the callbacks' methods
    that override ``Callback``'s, in order (``entry``), for the module and callbacks it was built
    for."""

    def __init__(self) -> None:
        self.module: Any = None
        self.callbacks: list[Any] | None = None
        self.members: list[int] = []  # the callbacks' ids when the table was built
        self.table: dict[str, tuple[Callable[..., Any] | None, tuple[Callable[..., Any], ...]]] = {}
        self._batch: BatchHooks | None = None

    def entry(self, hook: str, module: XModule, callbacks: list[Any]
              ) -> tuple[Callable[..., Any] | None, tuple[Callable[..., Any], ...]]:
        """Who implements ``hook``: the module's method (or None) and the callbacks' methods. The
        table starts again when the module or the callbacks are not those it was built for."""
        if self._stale(module, callbacks):
            self.module, self.callbacks, self.members, self.table = module, callbacks, list(map(id, callbacks)), {}
            self._batch = None
        entry = self.table.get(hook)
        if entry is None:
            entry = self.table[hook] = (_overriding(module, XModule, hook),
                                        tuple(fn for fn in (_overriding(cb, Callback, hook) for cb in callbacks)
                                              if fn is not None))
        return entry

    def batch(self, trainer: "TrainerView", module: XModule, callbacks: list[Any]) -> BatchHooks:
        """The hooks of a training batch, for ``module`` and ``callbacks``: built again only when
        they are not those the table was built for."""
        hooks = self._batch
        # _stale, inline: this runs on every batch
        if (hooks is None or module is not self.module or callbacks is not self.callbacks
                or list(map(id, callbacks)) != self.members):
            hooks = BatchHooks(*(self._caller(trainer, hook, module, callbacks) for hook in BatchHooks._fields))
            self._batch = hooks  # after the entries, which start the table again if it was stale
        return hooks

    def _stale(self, module: XModule, callbacks: list[Any]) -> bool:
        """Whether ``module`` and ``callbacks`` are not those the table was built for: another
        object, or the same list holding other callbacks (compared by identity)."""
        return (module is not self.module or callbacks is not self.callbacks
                or list(map(id, callbacks)) != self.members)

    def _caller(self, trainer: "TrainerView", hook: str, module: XModule, callbacks: list[Any]
                ) -> Callable[..., Any] | None:
        own, overriding = self.entry(hook, module, callbacks)
        if own is None and not overriding:
            return None
        bound = tuple(functools.partial(fn, trainer, module) for fn in overriding)
        if own is None and len(bound) == 1:  # one callback: called straight away
            return bound[0]
        return functools.partial(_in_order, own, bound)


def _in_order(own: Callable[..., Any] | None, callbacks: tuple[Callable[..., Any], ...], *args: Any) -> Any:
    """The callbacks' hooks (bound to the trainer and module), then the module's; the module's answer."""
    for fn in callbacks:
        fn(*args)
    return own(*args) if own is not None else None


def _overriding(obj: Any, base: type, hook: str) -> Callable[..., Any] | None:
    """``obj``'s bound ``hook`` unless it is ``base``'s own no-op. An object that decides its
    attributes itself (its own ``__getattribute__``: a proxy, a recorder) is asked on every call."""
    method = getattr(obj, hook)  # an object without the hook fails here, as calling it would
    if type(obj).__getattribute__ is not object.__getattribute__:
        return lambda *args: getattr(obj, hook)(*args)
    if hook not in getattr(obj, "__dict__", ()) and getattr(type(obj), hook, None) is getattr(base, hook, None):
        return None
    return method

