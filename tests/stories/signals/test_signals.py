"""Graceful stops on real signals, resumed bitwise; no orphaned replicas, ever."""

import os
import signal
import subprocess
import sys
import time

import conftest
import pytest
import torch

import signal_run
from conftest import subprocess_timeout
from xtrainer.checkpoint import load_checkpoint

TESTS = os.path.dirname(os.path.abspath(conftest.__file__))
ENV = {**os.environ, "PJRT_DEVICE": "CPU"}


def start(root, devices, when, out=None, **env):
    args = [sys.executable, signal_run.__file__, str(root), str(devices), when] + ([str(out)] if out else [])
    return subprocess.Popen(args, cwd=TESTS, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, **env})


def finish(proc, timeout=300):
    out, err = proc.communicate(timeout=subprocess_timeout(timeout))
    return proc.returncode, err


def start_training_with_two_replicas(root, devices=2, **env):
    """A fit (two replicas unless told), returned once it trains (rank 0 wrote its process id)."""
    proc = start(root, devices, "wait", **env)
    deadline = time.monotonic() + subprocess_timeout(240)
    while not (root / "pid").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    return proc


def straight(tmp_path, devices):
    return signal_run.run(str(tmp_path / "straight"), devices, "none")[1].state_dict()


def resume_and_compare(tmp_path, root, devices):
    """Resume ``root`` from ``last`` and compare with an uninterrupted run, bitwise. One replica
    resumes in this process (``signal_run.run`` seeds everything it draws from, so only the
    checkpoint carries the stopped run's state, as in a fresh process); several in a process of
    their own."""
    if devices == 1:
        resumed = signal_run.run(str(root), devices, "none", "last")[1].state_dict()
    else:
        code, err = finish(start(root, devices, "resume", tmp_path / "resumed.pt"))
        assert code == 0, err[-2000:]
        resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    for name, tensor in straight(tmp_path, devices).items():
        assert torch.equal(resumed[name], tensor), name


def test_sigterm_finishes_the_step_writes_a_checkpoint_exits_143_and_resumes_bitwise(tmp_path):
    root = tmp_path / "run"
    code, err = finish(start(root, 1, "self-term:5"))
    assert code == 143, err[-3000:]
    lines = [line for line in err.splitlines() if "Stopped by SIGTERM" in line]
    assert len(lines) == 1 and "at step 5, epoch 0; checkpoint: " in lines[0] and "ckpt_path='last'" in lines[0]
    path = lines[0].split("checkpoint: ")[1].split(". Resume")[0]
    saved = load_checkpoint(path)
    assert saved["loops"]["global_step"] == 5 and not saved["loops"]["epoch_finished"]
    assert saved["callbacks"]["SignalAt"]["noted"] == "TrainingInterrupted"  # on_exception ran before the save
    assert tuple(saved["callbacks"]["SignalAt"]["flags"]) == (True, True)  # interrupted, received_sigterm
    resume_and_compare(tmp_path, root, 1)


def test_a_second_sigint_stops_at_once(tmp_path):
    code, err = finish(start(tmp_path / "run", 1, "self-int2:3"))
    assert code != 0 and "KeyboardInterrupt" in err
    assert "Stopped by" not in err  # no graceful stop, no checkpoint of step 3
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    assert not checkpoints.exists() or not [n for n in os.listdir(checkpoints) if "step=3" in n]


@pytest.mark.multi_device
def test_sigterm_to_the_caller_stops_every_replica_together_and_resumes_bitwise(tmp_path):
    root = tmp_path / "run"
    proc = start_training_with_two_replicas(root)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)  # to the calling process only, as a supervisor does
    code, err = finish(proc)
    took = time.monotonic() - sent
    assert code == 143, err[-3000:]
    assert "Stopped by SIGTERM" in err and "checkpoint: " in err
    assert took < 30  # within Kubernetes' default grace period
    resume_and_compare(tmp_path, root, 2)


def test_spmd_stops_on_xlas_preemption_sync_at_one_agreed_step(tmp_path):
    """XLA's preemption sync owns SIGTERM in the SPMD process (as on a TPU pod, where it makes the
    hosts stop at one step): Python's handler never sees the signal, so only the agreed step stops
    the fit, and the checkpoint is written there."""
    root = tmp_path / "run"
    proc = start_training_with_two_replicas(root, devices=1, SIGNAL_RUN_STRATEGY="xla_spmd",
                                            XTRAINER_PREEMPTION_SYNC="1")
    proc.send_signal(signal.SIGTERM)  # the caller forwards it to the SPMD process
    code, err = finish(proc)
    assert code == 143, err[-3000:]
    assert "SIGTERM caught" in err  # by XLA's preemption notifier, not Python's handler
    line = next(line for line in err.splitlines() if "Stopped by SIGTERM" in line)
    path = line.split("checkpoint: ")[1].split(". Resume")[0]
    step = int(line.split(" at step ")[1].split(",")[0])
    saved = load_checkpoint(path)
    assert saved["loops"]["global_step"] == step >= 2  # the signal is sent once step 2 has ended
    assert saved["loops"]["epoch_finished"] == (step % 8 == 0)  # an agreed step may end an epoch (8 batches)


def test_a_mistyped_preemption_sync_setting_is_refused_before_anything_starts(monkeypatch):
    from xtrainer.strategies import XlaFSDPv2, XlaSPMD

    monkeypatch.setenv("XTRAINER_PREEMPTION_SYNC", "yes")
    for strategy in (XlaSPMD, XlaFSDPv2):
        with pytest.raises(ValueError, match="XTRAINER_PREEMPTION_SYNC='yes': use 1 .* or 0"):
            strategy()


@pytest.mark.multi_device
def test_the_replicas_never_outlive_their_caller(tmp_path):
    root = tmp_path / "run"
    # torch_xla's thread replicas run in a process of their own (the native strategies' rank 0 runs in
    # the caller: tests/stories/native/test_native_rank0.py)
    proc = start_training_with_two_replicas(root, SIGNAL_RUN_STRATEGY="xla_native")
    replicas = int((root / "pid").read_text())
    assert replicas != proc.pid  # the replicas' own process
    proc.kill()  # SIGKILL: no clean-up of any kind in the caller
    proc.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(replicas, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(replicas, signal.SIGKILL)
    pytest.fail("the replicas' process outlived its caller by 5 s")
