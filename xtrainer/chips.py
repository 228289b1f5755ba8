"""The names ``flops.PEAK_BF16_FLOPS`` gives chips, from what a device says of itself (standard
library only: ``_xla`` and the runtimes ask it without importing the rest of xtrainer)."""

from __future__ import annotations

#: Words in a CUDA device's name (``torch.cuda.get_device_name``) -> the table's name for it.
_GPU_NAMES = (("h200", "h200"), ("h100", "h100"), ("a100", "a100"))


def tpu_chip(accelerator_type: str) -> str | None:
    """The table's name of a TPU from its accelerator type (``TPU_ACCELERATOR_TYPE``: "v5litepod-8")."""
    accelerator = accelerator_type.lower()
    for prefix, name in (("v5litepod", "tpu-v5e"), ("v5lite", "tpu-v5e"), ("v5e", "tpu-v5e"),
                         ("v5p", "tpu-v5p"), ("v6e", "tpu-v6e"), ("v4", "tpu-v4")):
        if accelerator.startswith(prefix):
            return name
    return f"tpu-{accelerator.split('-')[0]}" if accelerator else None


def gpu_chip(device_name: str) -> str | None:
    """The table's name of a GPU from its device name ("NVIDIA H200"), or None if not in the table."""
    lowered = device_name.lower()
    return next((name for word, name in _GPU_NAMES if word in lowered), None)
