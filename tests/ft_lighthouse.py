"""A real torchft lighthouse on 127.0.0.1 (the ``torchft_lighthouse`` program torchft installs), on a
free port, for the fault-tolerance tests and benchmarks/recovery.py."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from typing import Iterator


def lighthouse_program() -> str | None:
    """The ``torchft_lighthouse`` next to this Python (its virtual environment), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    return here if os.access(here, os.X_OK) else shutil.which("torchft_lighthouse")


def _free_port() -> int:
    from xtrainer.strategies.launchers.processes import free_port

    return free_port()


class Lighthouse:
    """A running lighthouse: ``address`` (``http://127.0.0.1:PORT``), ``stop()`` (SIGKILL)."""

    def __init__(self, min_replicas: int = 1, heartbeat_timeout_ms: int = 1000, join_timeout_ms: int = 500,
                 quorum_tick_ms: int = 20) -> None:
        program = lighthouse_program()
        if program is None:
            raise RuntimeError("torchft_lighthouse not found: pip install 'xtrainer[ft]'")
        self.port = _free_port()
        self.address = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [program, "--min_replicas", str(min_replicas), "--bind", f"127.0.0.1:{self.port}",
             "--heartbeat_timeout_ms", str(heartbeat_timeout_ms), "--join_timeout_ms", str(join_timeout_ms),
             "--quorum_tick_ms", str(quorum_tick_ms)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:  # up once it accepts connections
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"torchft_lighthouse did not start on port {self.port}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


@contextlib.contextmanager
def running_lighthouse(**kwargs: int) -> Iterator[Lighthouse]:
    lighthouse = Lighthouse(**kwargs)
    try:
        yield lighthouse
    finally:
        lighthouse.stop()
