"""Who implements each hook: ``Trainer._call`` calls only those.

Every hook of ``XModule`` and ``Callback`` is a no-op unless overridden, and a fit calls five of
them on every batch. Calling the module's and every callback's hook each time costs a lookup and
a call per object per hook for nothing; the table looks up once which of them override a hook
(in the class, or set on the instance) and keeps their bound methods. It is built again when the
module or the list of callbacks changes (another list, or one grown or shrunk); a method set on a
module or callback after a hook was first called in a run is not seen. An object with its own
``__getattribute__`` is asked for the hook on every call.
"""

from __future__ import annotations

from typing import Any, Callable

from xtrainer.callbacks.base import Callback
from xtrainer.module import XModule


class HookTable:
    """Per hook: the module's method if it overrides ``XModule``'s, and the callbacks' methods
    that override ``Callback``'s, in order (``entry``), for the module and callbacks it was built
    for."""

    def __init__(self) -> None:
        self.module: Any = None
        self.callbacks: list[Any] | None = None
        self.count = -1
        self.table: dict[str, tuple[Callable[..., Any] | None, tuple[Callable[..., Any], ...]]] = {}

    def entry(self, hook: str, module: XModule, callbacks: list[Any]
              ) -> tuple[Callable[..., Any] | None, tuple[Callable[..., Any], ...]]:
        """Who implements ``hook``: the module's method (or None) and the callbacks' methods. The
        table starts again when the module or the callbacks are not those it was built for."""
        if module is not self.module or callbacks is not self.callbacks or len(callbacks) != self.count:
            self.module, self.callbacks, self.count, self.table = module, callbacks, len(callbacks), {}
        entry = self.table.get(hook)
        if entry is None:
            entry = self.table[hook] = (_overriding(module, XModule, hook),
                                        tuple(fn for fn in (_overriding(cb, Callback, hook) for cb in callbacks)
                                              if fn is not None))
        return entry


def _overriding(obj: Any, base: type, hook: str) -> Callable[..., Any] | None:
    """``obj``'s bound ``hook`` unless it is ``base``'s own no-op. An object that decides its
    attributes itself (its own ``__getattribute__``: a proxy, a recorder) is asked on every call."""
    method = getattr(obj, hook)  # an object without the hook fails here, as calling it would
    if type(obj).__getattribute__ is not object.__getattribute__:
        return lambda *args: getattr(obj, hook)(*args)
    if hook not in getattr(obj, "__dict__", ()) and getattr(type(obj), hook, None) is getattr(base, hook, None):
        return None
    return method

