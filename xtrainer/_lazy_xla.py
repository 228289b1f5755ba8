"""``xla``: ``xtrainer._xla`` (the only module that imports torch_xla), imported on first use.

Modules that the native strategies (``strategies/native.py``) share with the XLA ones
import ``from xtrainer._lazy_xla import xla as _xla``, so that ``import xtrainer`` and the native
strategies work where torch_xla is not installed. Once imported, each use costs one attribute
lookup more than a plain module would.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class _LazyXla:
    """Forwards every attribute to ``xtrainer._xla``, importing it at the first one."""

    _module: ModuleType | None = None

    def __getattr__(self, name: str) -> Any:
        module = _LazyXla._module
        if module is None:
            try:
                module = importlib.import_module("xtrainer._xla")
            except ModuleNotFoundError as err:
                if err.name is None or not err.name.startswith("torch_xla"):
                    raise
                raise ModuleNotFoundError(
                    "This needs torch_xla, which is not installed: install it (pip install 'torch_xla==2.9.*'), "
                    "or use a native strategy (strategy='native', 'native_ddp' or 'native_fsdp').",
                    name=err.name) from err
            _LazyXla._module = module
        return getattr(module, name)


#: ``xtrainer._xla``, imported when one of its names is first used.
xla = _LazyXla()
