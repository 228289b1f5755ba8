"""``grad_norm``: Lightning's per-parameter gradient norms, for logging."""

from __future__ import annotations

import torch
from torch import nn


def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, torch.Tensor]:
    """The ``norm_type`` norm of each parameter's gradient, named ``grad_{norm}_norm{sep}{name}``,
    and of all of them together, ``grad_{norm}_norm_total``, as Lightning's ``grad_norm`` names
    them (``self.log_dict(grad_norm(self, 2))`` in ``on_before_optimizer_step``). The values stay
    on the device: logging them costs no host sync. Parameters without a gradient are left out."""
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"grad_norm: norm_type must be a positive number or 'inf', got {norm_type}.")
    norms = {f"grad_{norm_type}_norm{group_separator}{name}": param.grad.data.norm(norm_type)
             for name, param in module.named_parameters() if param.grad is not None}
    if norms:  # the norm of the parameters' norms is the norm of all their elements together
        norms[f"grad_{norm_type}_norm_total"] = torch.stack(list(norms.values())).norm(norm_type)
    return norms
