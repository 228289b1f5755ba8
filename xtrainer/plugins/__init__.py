"""Lightning's ``lightning.pytorch.plugins``: the cluster environments (``environments``); its
precision and checkpoint-IO plugins have no counterpart here (``precision=`` and the strategy's
arguments cover them)."""

from xtrainer.plugins.environments import ClusterEnvironment, SLURMEnvironment

__all__ = ["ClusterEnvironment", "SLURMEnvironment"]
