"""Cluster environments: where a job's processes come from when a scheduler starts them, and what
the scheduler expects of a run that it stops (Lightning's ``ClusterEnvironment`` plugins).

``Trainer(plugins=[SLURMEnvironment(...)])`` names one; without one, the environment of the
scheduler that started this process is found by itself (``detect``), as Lightning finds it. The
one found gives the strategy torch's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``...) before it is configured, so that each process runs its replica in place, as
under torchrun. ``SLURMEnvironment`` (``slurm.py``) is the one there is.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from xtrainer.clusters.base import ClusterEnvironment
from xtrainer.clusters.slurm import SLURMEnvironment, expand_hostlist

__all__ = ["ClusterEnvironment", "SLURMEnvironment", "expand_hostlist", "from_plugins", "prepare"]

#: The environments tried, in order, where none is given.
_DETECTED: tuple[type[ClusterEnvironment], ...] = (SLURMEnvironment,)


#: The class paths a configuration may name a cluster environment by (a ``LightningCLI`` config's
#: ``trainer.plugins``, kept as data there): built from their ``init_args`` here; nothing else is.
SPEC_CLASSES: dict[str, type[ClusterEnvironment]] = {
    f"{package}.SLURMEnvironment": SLURMEnvironment
    for package in ("lightning.pytorch.plugins.environments", "lightning.fabric.plugins.environments",
                    "pytorch_lightning.plugins.environments", "xtrainer.plugins.environments", "xtrainer.clusters")}


def _from_spec(plugin: Any) -> Any:
    """A ``{"class_path": ..., "init_args": {...}}`` naming a cluster environment, built (a
    signal given by name, ``SIGUSR2``, or number); anything else as it is."""
    if not isinstance(plugin, dict) or plugin.get("class_path") not in SPEC_CLASSES:
        return plugin
    kwargs = dict(plugin.get("init_args") or {})
    signum = kwargs.get("requeue_signal")
    if isinstance(signum, str):
        name = signum.rsplit(".", 1)[-1].upper()  # "SIGUSR2", "signal.SIGUSR2", "usr2"
        found = getattr(signal, name if name.startswith("SIG") else f"SIG{name}", None)
        if not isinstance(found, signal.Signals):
            raise ValueError(f"plugins: {plugin['class_path']}(requeue_signal={signum!r}): give a signal's name "
                             "(SIGUSR1, the default, or the one #SBATCH --signal names) or number.")
        kwargs["requeue_signal"] = found
    return SPEC_CLASSES[plugin["class_path"]](**kwargs)


def from_plugins(plugins: Any) -> tuple[ClusterEnvironment | None, list[Any]]:
    """The cluster environment among Lightning's ``plugins`` (one at most; also as a config's
    class spec, ``SPEC_CLASSES``), and the others."""
    given = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    given = [_from_spec(plugin) for plugin in given]
    environments = [plugin for plugin in given if isinstance(plugin, ClusterEnvironment)]
    if len(environments) > 1:
        raise ValueError(f"plugins=...: {len(environments)} cluster environments given "
                         f"({', '.join(type(env).__name__ for env in environments)}); give one.")
    return (environments[0] if environments else None), [p for p in given if not isinstance(p, ClusterEnvironment)]


def prepare(environment: ClusterEnvironment | None, devices: Any, num_nodes: int) -> ClusterEnvironment | None:
    """The environment this process runs in (``environment``, else the one detected, else None),
    checked against ``devices``/``num_nodes`` and with torch's variables set from it where the
scheduler started this process as one of several (``creates_processes_externally``). A given
    environment that does not apply here (a ``SLURMEnvironment`` outside a SLURM job) changes
    nothing, as in Lightning."""
    if environment is None:
        environment = next((kind() for kind in _DETECTED if kind.detect()), None)
    if environment is None or not environment.detect() or not environment.creates_processes_externally:
        return environment  # (SLURM's batch script itself: its processes start here, as on any machine)
    environment.validate_settings(devices, num_nodes)
    environment.export_process_group_env(os.environ)
    return environment
