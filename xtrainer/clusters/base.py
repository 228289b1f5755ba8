"""``ClusterEnvironment``: what a scheduler's environment tells a process (Lightning's interface of
the same name), and what a stage asks of it: the signals that stop a fit gracefully, what to do
once such a stop has written its checkpoint, and the checkpoint a restarted job continues from."""

from __future__ import annotations

from typing import Any, MutableMapping


class ClusterEnvironment:
    """A scheduler's view of this process (Lightning's ``ClusterEnvironment``). Subclasses read
    the scheduler's variables; the defaults are those of one process on its own."""

    @property
    def creates_processes_externally(self) -> bool:
        """The scheduler started this process as one of the job's (``srun``): its ranks are the
        scheduler's, and no process is started here."""
        return False

    @staticmethod
    def detect() -> bool:
        """Whether this process was started by this environment's scheduler."""
        return False

    @property
    def main_address(self) -> str:
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        return 29500

    def world_size(self) -> int:
        return 1

    def global_rank(self) -> int:
        return 0

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return 0

    def local_world_size(self) -> int:
        return 1

    def num_nodes(self) -> int:
        return 1

    def validate_settings(self, num_devices: Any, num_nodes: int) -> None:
        """Refuse ``Trainer(devices=..., num_nodes=...)`` that the allocation does not match."""

    def export_process_group_env(self, environ: MutableMapping[str, str]) -> None:
        """torch's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
        ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) from this environment, unless a launcher
        (torchrun inside the job) has set them already: the native strategies then run this
        process's replica in place."""
        if all(name in environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")):
            return
        environ.update({"RANK": str(self.global_rank()), "WORLD_SIZE": str(self.world_size()),
                        "LOCAL_RANK": str(self.local_rank()), "LOCAL_WORLD_SIZE": str(self.local_world_size()),
                        "GROUP_RANK": str(self.node_rank()), "MASTER_ADDR": self.main_address,
                        "MASTER_PORT": str(self.main_port)})

    # ---- what a stage asks ---------------------------------------------------------------------
    def stop_signals(self) -> tuple[int, ...]:
        """Signals, beyond SIGTERM and SIGINT, that stop a fit gracefully (the agreed stop) and end
        an evaluation at once."""
        return ()

    def stopped(self, signum: int) -> None:
        """A stage stopped on ``signum`` (a fit after writing its checkpoint; every rank calls this)."""

    def fit_ckpt_path(self, ckpt_path: Any) -> Any:
        """The ``ckpt_path`` a fit of this job starts from, given the user's."""
        return ckpt_path
