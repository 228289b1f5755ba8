"""``native_ddp`` on 4 processes, stopped by SIGTERM mid-fit and resumed from ``last``, ends
bitwise equal to an uninterrupted run, with a model whose gradient sums are not exact.

The fit is ``signal_run.py``'s (an MLP with dropout, float32, Adam, 2 samples per process): summed
over 4 processes, its gradients take different last bits in another order of addition. DDP lays
its buckets out anew when the resumed run wraps the module and, after the first backward, in the
order gradients became ready: with gloo's ring all-reduce, the first step after the resume added
in another order than the uninterrupted run did at that step, and the weights ended 3e-8 apart.
``NativeDDP`` sums in rank order at 3 processes or more on gloo (``_rank_order_mean``), the same
at every layout. This file imports nothing of torch_xla.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import subprocess_timeout
from test_native import HERE, _assert_bitwise, _env
from xtrainer.strategies.native import NativeDDP

STEPS = 24  # signal_run.py's 3 epochs of 64 samples, 8 per step


def _signal_run(root, when: str, out=None) -> subprocess.CompletedProcess:
    env = {**_env(), "SIGNAL_RUN_STRATEGY": "native_ddp"}
    return subprocess.run([sys.executable, os.path.join(HERE, "signal_run.py"), str(root), "4", when,
                           *([str(out)] if out else [])], env=env, capture_output=True, text=True,
                          timeout=subprocess_timeout(240))


@pytest.mark.slow
@pytest.mark.multi_device
def test_four_processes_stopped_by_sigterm_resume_bitwise(tmp_path):
    reference = _signal_run(tmp_path / "ref", "none", tmp_path / "ref.pt")
    assert reference.returncode == 0, reference.stderr[-3000:]
    stopped = _signal_run(tmp_path / "run", "self-term:4")  # rank 0's process sends itself SIGTERM
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    step = re.search(r"Stopped by SIGTERM at step (\d+)", stopped.stderr)
    assert step and 4 <= int(step.group(1)) < STEPS, stopped.stderr[-3000:]  # mid-fit
    resumed = _signal_run(tmp_path / "run", "resume", tmp_path / "out.pt")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_bitwise(torch.load(tmp_path / "out.pt"), torch.load(tmp_path / "ref.pt"))


def test_reduce_in_rank_order_is_none_true_or_false():
    with pytest.raises(ValueError, match=r"reduce_in_rank_order=1\): give None, True or False"):
        NativeDDP(reduce_in_rank_order=1)
