"""The examples from the command line under ``native_ddp`` on two processes (``xtrainer fit
--config examples/NAME.yaml``): the main environment's, which has the examples' dependencies."""

from __future__ import annotations

import os
import subprocess
import sys

import conftest
import pytest
from conftest import subprocess_timeout

HERE = os.path.dirname(os.path.abspath(conftest.__file__))  # tests/
ROOT = os.path.dirname(HERE)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")])}


@pytest.mark.slow
@pytest.mark.multi_device
@pytest.mark.parametrize("example, needs", [("digits", "sklearn"), ("tiny_llama", "transformers")])
def test_the_examples_run_under_native_ddp_on_two_processes_from_the_cli(tmp_path, example, needs):
    """``xtrainer fit --config examples/NAME.yaml trainer.strategy=native_ddp trainer.devices=2``
    with a few steps: exit 0, a checkpoint written by two processes of native_ddp. Here, not in
    tests/stories/native/: it needs the examples' dependencies, which the main environment has (the
    native strategies' own files run in the second one, ``./dev test-native``)."""
    pytest.importorskip(needs)
    from xtrainer.checkpoint import verify

    exe = os.path.join(os.path.dirname(sys.executable), "xtrainer")
    run = subprocess.run([exe, "fit", "--config", f"examples/{example}.yaml", "trainer.strategy=native_ddp",
                          "trainer.devices=2", "trainer.max_steps=2", "trainer.limit_val_batches=1",
                          f"trainer.default_root_dir={tmp_path}"],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=subprocess_timeout(400))
    assert run.returncode == 0, run.stderr[-3000:]
    header = verify(os.path.join(tmp_path, "version_0", "checkpoints", "last.ckpt"))
    assert (header.strategy, header.world_size, header.global_step) == ("native_ddp", 2, 2)
