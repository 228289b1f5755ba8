"""The Trainer's settings: one dataclass, read by ``Trainer.__init__`` and by the configuration
schema (``xtrainer.config.TrainerConfig`` adds only what YAML spells differently), so a new
setting appears in both with one edit. ``check()`` refuses a bad value with a message that names
it and says what to give instead."""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from typing import Any, Optional, Union


@dataclass
class TrainerSettings:
    """Every ``Trainer`` argument but ``strategy``, ``callbacks`` and ``logger`` (objects)."""

    devices: Any = "auto"
    max_epochs: Optional[int] = None
    max_steps: int = -1
    limit_train_batches: Union[int, float] = 1.0
    limit_val_batches: Union[int, float] = 1.0
    limit_test_batches: Union[int, float] = 1.0
    limit_predict_batches: Union[int, float] = 1.0
    # a fraction of an epoch (float), a number of batches (int), or a time ('DD:HH:MM:SS', a timedelta, a dict)
    val_check_interval: Any = 1.0
    check_val_every_n_epoch: Optional[int] = 1
    log_every_n_steps: int = 50
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = None
    gradient_clip_algorithm: str = "norm"
    precision: str = "32"
    default_root_dir: Optional[str] = None
    enable_progress_bar: bool = True
    enable_checkpointing: bool = True
    enable_xla_health: bool = True
    detect_nonfinite: str = "raise"
    # Goodput (xtrainer/compile_cache.py, watchdog.py, goodput.py).
    compilation_cache: Any = None
    hang_timeout: Any = "auto"
    exit_on_hang: bool = False
    enable_goodput: bool = True
    async_checkpointing: bool = False
    # Lightning's names, with Lightning's meaning (docs/lightning.md, "Coming from Lightning").
    accelerator: str = "auto"
    num_nodes: int = 1
    fast_dev_run: Any = False
    num_sanity_val_steps: int = 2
    overfit_batches: Union[int, float] = 0.0
    deterministic: Optional[bool] = None
    min_epochs: Optional[int] = None
    min_steps: Optional[int] = None
    max_time: Any = None
    enable_model_summary: bool = True
    benchmark: Optional[bool] = None
    sync_batchnorm: bool = False
    reload_dataloaders_every_n_epochs: int = 0
    profiler: Optional[str] = None
    use_distributed_sampler: bool = True
    inference_mode: bool = True
    detect_anomaly: bool = False
    barebones: bool = False

    def check(self) -> "TrainerSettings":
        """Refuse bad values (``ValueError``/``TypeError`` naming the argument); fill defaults that
        depend on others. Returns ``self``."""
        if isinstance(self.fast_dev_run, bool) or self.fast_dev_run is None:
            self.fast_dev_run = bool(self.fast_dev_run)
        elif not isinstance(self.fast_dev_run, int) or self.fast_dev_run < 0:
            raise ValueError(f"fast_dev_run={self.fast_dev_run!r}: give True, False or a number of batches.")
        self.devices = lightning_devices(self.devices)
        if self.max_epochs is None:  # as Lightning: 1000, unless max_steps or max_time ends the fit
            self.max_epochs = 1000 if self.max_steps == -1 and self.max_time is None else -1
        if not (self.max_epochs == -1 and type(self.max_epochs) is int):  # -1: no limit on epochs
            _check_positive("max_epochs", self.max_epochs)
        if self.max_steps != -1:
            _check_positive("max_steps", self.max_steps)
        _check_positive("log_every_n_steps", self.log_every_n_steps)
        _check_positive("accumulate_grad_batches", self.accumulate_grad_batches)
        _check_positive("check_val_every_n_epoch", self.check_val_every_n_epoch, allow_none=True)
        for name in ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches"):
            _check_limit(name, getattr(self, name))
        if is_time(self.val_check_interval):
            seconds(self.val_check_interval, "val_check_interval")  # refuses a malformed one
        else:
            _check_limit("val_check_interval", self.val_check_interval)
        if self.detect_nonfinite not in ("raise", "warn", "off"):
            raise ValueError(f"detect_nonfinite={self.detect_nonfinite!r}: use 'raise', 'warn' or 'off'.")
        if self.gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm={self.gradient_clip_algorithm!r}: use 'norm' or 'value'.")
        _check_goodput(self)
        accelerator = str(self.accelerator).lower()
        if accelerator == "mps":
            raise ValueError(f"accelerator={self.accelerator!r}: xtrainer runs on XLA devices, or with a native "
                             "strategy on 'cpu', 'cuda', 'tpu' (TorchTPU) or 'neuron' (TorchNeuron); not on MPS.")
        from xtrainer.runtimes import native_accelerator

        if accelerator not in ("auto", "tpu", "xla", "cpu", "gpu", "cuda", "neuron") \
                and accelerator != native_accelerator():
            raise ValueError(f"accelerator={self.accelerator!r}: use 'auto', 'cpu', 'cuda'/'gpu', 'tpu', 'neuron', "
                             "a device type that PyTorch registered, or 'xla' (torch_xla).")
        _check_positive("num_nodes", self.num_nodes)
        if isinstance(self.num_sanity_val_steps, bool) or not isinstance(self.num_sanity_val_steps, int) \
                or self.num_sanity_val_steps < -1:
            raise ValueError(f"num_sanity_val_steps={self.num_sanity_val_steps!r}: give a number of batches, "
                             "0 (none) or -1 (all).")
        _check_limit("overfit_batches", self.overfit_batches)
        _check_positive("min_epochs", self.min_epochs, allow_none=True)
        _check_positive("min_steps", self.min_steps, allow_none=True)
        if self.reload_dataloaders_every_n_epochs != 0:
            _check_positive("reload_dataloaders_every_n_epochs", self.reload_dataloaders_every_n_epochs)
        if self.gradient_clip_val is not None and self.gradient_clip_val <= 0:
            raise ValueError(f"gradient_clip_val={self.gradient_clip_val} must be positive (or None for no clipping).")
        return self

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


def lightning_devices(devices: Any) -> Any:
    """Lightning's spellings of ``devices`` as xtrainer's (a count or ``"auto"``): ``-1`` and
    ``"-1"`` (every device) are ``"auto"``; ``"2"`` is 2; a list of indices (``[0, 1]``,
    ``"0,1"``) is their count when they are the first ones. Other indices are refused: the
    strategies take the first devices the process sees. Anything else passes unchanged, for the
    strategy to check."""
    if isinstance(devices, str):
        text = devices.strip()
        if text == "-1":
            return "auto"
        if text.lstrip("-").isdigit():
            return int(text)
        if "," in text:
            parts = [part.strip() for part in text.split(",") if part.strip()]
            if not all(part.isdigit() for part in parts):
                return devices
            devices = [int(part) for part in parts]
    if devices == -1 and type(devices) is int:
        return "auto"
    if isinstance(devices, (list, tuple)) and devices and all(type(i) is int for i in devices):
        if sorted(devices) != list(range(len(devices))):
            raise ValueError(f"devices={devices!r}: xtrainer uses the first devices this process sees, not chosen "
                             f"ones. Make the ones you want visible (CUDA_VISIBLE_DEVICES={','.join(map(str, devices))}, "
                             f"or your platform's equivalent) and pass devices={len(devices)}.")
        return len(devices)
    return devices


def _check_goodput(settings: TrainerSettings) -> None:
    cache = settings.compilation_cache
    if not (cache is None or isinstance(cache, bool) or (isinstance(cache, str) and cache.strip())
            or hasattr(cache, "__fspath__")):
        raise ValueError(f"compilation_cache={cache!r}: give True (a cache under the runs root), False (none), "
                         "a folder, or leave it unset (on wherever the runtime can load it).")
    timeout = settings.hang_timeout
    if timeout is False:
        settings.hang_timeout = None
    elif not (timeout is None or timeout == "auto" or (isinstance(timeout, (int, float)) and not isinstance(
            timeout, bool) and timeout > 0)):
        raise ValueError(f"hang_timeout={timeout!r}: give a number of seconds, 'auto' (a multiple of the median step "
                         "time, at least a few minutes) or None (no hang watchdog).")
    if settings.exit_on_hang and settings.hang_timeout is None:
        raise ValueError("exit_on_hang=True needs the hang watchdog: set hang_timeout (seconds or 'auto').")


def _check_positive(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int.")


def _check_limit(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={value!r}: give a fraction (float) or a number of batches (int).")
    if isinstance(value, float) and not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={value} as a fraction must lie in [0.0, 1.0]; give an int for a batch count.")
    if isinstance(value, int) and value < 0:
        raise ValueError(f"{name}={value} must not be negative.")
    if name == "val_check_interval" and value == 0:
        raise ValueError("val_check_interval must be positive.")


def is_time(value: Any) -> bool:
    """Whether ``val_check_interval`` is a time (Lightning 2.6's forms), not batches."""
    return isinstance(value, (str, dict, datetime.timedelta))


def seconds(max_time: Any, name: str = "max_time") -> float | None:
    """``max_time`` (or ``Timer``'s ``duration``, or a time-based ``val_check_interval``: ``name``)
    as seconds: ``"DD:HH:MM:SS"``, a ``timedelta``, or a dict of its fields."""
    if max_time is None:
        return None
    if isinstance(max_time, datetime.timedelta):
        return max_time.total_seconds()
    if isinstance(max_time, dict):
        try:
            return datetime.timedelta(**max_time).total_seconds()
        except TypeError:
            raise ValueError(f"{name}={max_time!r}: a dict takes timedelta's fields (days, hours, minutes, "
                             "seconds).") from None
    if isinstance(max_time, str):
        parts = max_time.split(":")
        if len(parts) == 4 and all(p.strip().isdigit() for p in parts):
            days, hours, minutes, secs = (int(p) for p in parts)
            return datetime.timedelta(days=days, hours=hours, minutes=minutes, seconds=secs).total_seconds()
    raise ValueError(f"{name}={max_time!r}: give 'DD:HH:MM:SS' (e.g. '00:12:00:00'), a timedelta or a dict "
                     "such as {'hours': 12}.")
