"""A signal that reaches one host of several: every replica stops at one step, on one path.

Two torchrun "nodes" of ``native_ddp`` (one process each, one c10d rendezvous on localhost) and a
signal to one node's torchrun only, which forwards it to its worker. The other worker learns of
it through the stop vote the logging steps already exchange (it carries the signal's number), takes
it as its own request, and both write one checkpoint together and exit 128 + the signal (143 for
SIGTERM, 130 for SIGINT) within a few seconds, far below torchrun's 30 s grace period; a resume
from ``last`` then ends bitwise equal to a run never stopped. Also where the stop comes at an
epoch's last batch and during validation. The fit is ``trust3_signal_run.py``'s (native_run's
exact module: runs of different world sizes compare bitwise). Imports nothing of torch_xla.
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import trust3_signal_run
from xtrainer.launch import interrupts
from test_native import HERE, _assert_bitwise, _env, _torchrun, _weights

STEPS = 24  # three epochs of 8 batches; validation every 4
GRACE = 30  # torchrun's wait for its workers after forwarding a signal, before SIGKILL


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The same fit on two processes the Trainer starts, never stopped: the reference weights (the
    same world size: 24 steps are not exact in float64 across world sizes)."""
    root = str(tmp_path_factory.mktemp("uninterrupted"))
    args = argparse.Namespace(root=root, steps=STEPS, pause=0.0, ready=None, signal=None, ckpt=None)
    trainer, model = trust3_signal_run.fit(args, 2, devices=2)
    assert trainer.global_step == STEPS
    return _weights(model)


def _nodes(root, name: str, *args: str) -> list[subprocess.Popen]:
    """Two torchrun commands of one process each (two "nodes" on localhost), one c10d rendezvous."""
    from xtrainer.strategies.launchers.processes import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    script = [os.path.join(HERE, "trust3_signal_run.py"), "--root", str(root), "--out", str(root / "out.pt"),
              "--steps", str(STEPS), *args]
    return [subprocess.Popen(_torchrun("--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1",
                                       "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={name}",
                                       *script),
                             env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for node in range(2)]


def _wait(nodes: list[subprocess.Popen], timeout: float) -> list[str]:
    """Both nodes' stderr once they ended (killed, and the test failed, past ``timeout``)."""
    errs = []
    for node in nodes:
        try:
            errs.append(node.communicate(timeout=timeout)[1])
        except subprocess.TimeoutExpired:
            for other in nodes:
                other.kill()
            raise
    return errs


def _per_rank(root, kind: str) -> dict[int, str]:
    return {int(os.path.basename(p)[5:-len(kind) - 1]): open(p).read() for p in glob.glob(str(root / f"rank-*.{kind}"))}


def _assert_stopped_together(root, signum: int, errs: list[str]) -> int:
    """Both workers exited 128 + ``signum`` with the signal as their own request, at one step, and
    ``last.ckpt`` is the checkpoint of that step. Returns the step."""
    detail = (errs[0][-3000:], errs[1][-3000:])
    assert _per_rank(root, "exit") == {0: str(128 + signum), 1: str(128 + signum)}, detail
    assert _per_rank(root, "signal") == {0: str(signum), 1: str(signum)}, detail
    steps = set(_per_rank(root, "step").values())
    assert len(steps) == 1, (steps, detail)
    step = int(steps.pop())
    [folder] = glob.glob(str(root / "version_*"))
    last = os.path.realpath(os.path.join(folder, "checkpoints", "last.ckpt"))
    assert f"step={step}" in os.path.basename(last), (last, detail)
    stopped = [line for err in errs for line in err.splitlines() if f"Stopped by {signal.Signals(signum).name} at step {step}" in line]
    assert len(stopped) == 2, detail  # each rank says where the checkpoint is
    return step


def _resume(root, uninterrupted) -> None:
    for path in glob.glob(str(root / "rank-*")):
        os.remove(path)
    errs = _wait(_nodes(root, "resume", "--ckpt", "last"), timeout=400)
    assert _per_rank(root, "exit") == {0: "0", 1: "0"}, (errs[0][-3000:], errs[1][-3000:])
    resumed = torch.load(root / "out.pt")
    assert resumed["global_step"] == STEPS
    _assert_bitwise(resumed["weights"], uninterrupted)


@pytest.mark.slow
@pytest.mark.multi_device
# rank 0's node serves the rendezvous; a signal to rank 1's node alone is in the epoch-end story below
@pytest.mark.parametrize("rank", [0], ids=["rank-0s-node"])
def test_sigterm_to_one_torchrun_of_two_stops_both_at_one_step_exits_143_and_resumes_bitwise(tmp_path, uninterrupted,
                                                                                            rank):
    root = tmp_path / "run"
    root.mkdir()
    ready = tmp_path / "ready"
    nodes = _nodes(root, f"one-of-two-{rank}", "--pause", "0.3", "--ready", str(ready))
    marker = tmp_path / f"ready-{rank}"  # the rank's pid, once it is past step 3
    deadline = time.monotonic() + 240
    while not marker.exists() and all(n.poll() is None for n in nodes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), [n.poll() for n in nodes]
    worker = int(marker.read_text())
    with open(f"/proc/{worker}/stat") as f:
        launcher = int(f.read().rsplit(")", 1)[1].split()[1])  # its parent: that node's torchrun
    [node] = [n for n in nodes if n.pid == launcher]
    sent = time.monotonic()
    node.send_signal(signal.SIGTERM)  # that node's alone
    errs = _wait(nodes, timeout=3 * GRACE)
    took = time.monotonic() - sent
    step = _assert_stopped_together(root, signal.SIGTERM, errs)
    assert took < GRACE / 2, (took, errs[0][-3000:], errs[1][-3000:])  # no rank waited out the grace period
    assert 3 <= step < STEPS
    assert "SIGTERM received" in errs[nodes.index(node)]
    _resume(root, uninterrupted)


@pytest.mark.slow
@pytest.mark.multi_device
@pytest.mark.parametrize("rank", [0], ids=["rank-0s-node"])  # the node whose torchrun serves the rendezvous
def test_sigkill_to_one_torchrun_of_two_stops_both_workers_at_one_step_and_resumes_bitwise(tmp_path, uninterrupted,
                                                                                          rank):
    """One node's torchrun killed alone (SIGKILL: the out-of-memory killer, a person): its worker
    gets SIGTERM as its parent dies (the parent-death signal set under torchrun) instead of
    training on without a launcher, and both workers stop at one step with one checkpoint and
    exit 143; that torchrun is gone (-9), the other fails; a resume ends bitwise."""
    root = tmp_path / "run"
    root.mkdir()
    nodes = _nodes(root, f"killed-{rank}", "--pause", "0.3", "--ready", str(tmp_path / "ready"))
    marker = tmp_path / f"ready-{rank}"
    deadline = time.monotonic() + 240
    while not marker.exists() and all(n.poll() is None for n in nodes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), [n.poll() for n in nodes]
    with open(f"/proc/{int(marker.read_text())}/stat") as f:
        launcher = int(f.read().rsplit(")", 1)[1].split()[1])
    [node] = [n for n in nodes if n.pid == launcher]
    sent = time.monotonic()
    node.kill()
    errs = _wait(nodes, timeout=3 * GRACE)
    assert time.monotonic() - sent < GRACE, (errs[0][-3000:], errs[1][-3000:])
    step = _assert_stopped_together(root, signal.SIGTERM, errs)
    assert 3 <= step < STEPS
    [other] = [n for n in nodes if n is not node]
    assert node.returncode == -signal.SIGKILL and other.returncode not in (0, None), (node.returncode, other.returncode)
    _resume(root, uninterrupted)


@pytest.mark.slow
@pytest.mark.multi_device
@pytest.mark.parametrize("name, rank, at, where", [("TERM", 1, 8, "train"), ("INT", 0, 4, "validation")],
                         ids=["sigterm-at-an-epochs-last-batch", "sigint-in-validation"])
def test_a_signal_to_one_node_at_an_epochs_end_or_in_validation_stops_both_together(tmp_path, uninterrupted, name,
                                                                                     rank, at, where):
    """One rank's torchrun is signalled by the rank itself at a chosen point (its step then waits
    until the forwarded signal has arrived); the other rank gets none."""
    root = tmp_path / "run"
    root.mkdir()
    signum = getattr(signal, f"SIG{name}")
    errs = _wait(_nodes(root, f"{name}-{where}-{at}", "--signal", name, "--rank", str(rank), "--at", str(at),
                        "--where", where), timeout=3 * GRACE + 120)
    step = _assert_stopped_together(root, signum, errs)
    assert step in (at, at + 1), step  # taken at the next agreement
    _resume(root, uninterrupted)


def _signal_self(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.2)  # the handler runs in this (the main) thread, at the next instruction


def test_one_ctrl_c_delivered_twice_is_one_request_and_a_later_one_stops_at_once(monkeypatch):
    """A terminal's Ctrl-C reaches every process of its foreground group, and torchrun (or the
    calling process of devices=N) forwards it to each worker as well: a worker gets it twice, a
    moment apart. That is one graceful request (it stopped every rank at once, with no checkpoint,
    before); a Ctrl-C after the window still stops at once."""
    monkeypatch.setattr(interrupts, "SAME_CTRL_C_SECONDS", 1.0)
    with interrupts.graceful(announce=False):
        _signal_self(signal.SIGINT)
        _signal_self(signal.SIGINT)  # the same Ctrl-C, forwarded
        assert interrupts.requested() == signal.SIGINT
        time.sleep(1.1)
        with pytest.raises(KeyboardInterrupt):
            _signal_self(signal.SIGINT)


def test_a_signal_learnt_from_another_replica_is_this_processs_request_but_no_first_ctrl_c():
    """An adopted SIGINT: this process's own Ctrl-C after it (a terminal's, reaching each host a
    little apart) is its first, still graceful; a second one stops at once. The larger signal
    number wins where both came, as the vote's does."""
    with interrupts.graceful(announce=False):
        assert interrupts.requested() is None
        interrupts.adopt(signal.SIGINT)
        assert interrupts.requested() == signal.SIGINT
        _signal_self(signal.SIGINT)
        assert interrupts.requested() == signal.SIGINT
        time.sleep(interrupts.SAME_CTRL_C_SECONDS)  # a second Ctrl-C, not the first delivered again
        with pytest.raises(KeyboardInterrupt):
            _signal_self(signal.SIGINT)
    with interrupts.graceful(announce=False):
        _signal_self(signal.SIGINT)
        time.sleep(interrupts.SAME_CTRL_C_SECONDS)
        interrupts.adopt(signal.SIGTERM)  # another replica had SIGTERM: every replica exits 143
        assert interrupts.requested() == signal.SIGTERM
        interrupts.adopt(signal.SIGINT)
        assert interrupts.requested() == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):  # this process's own Ctrl-C came before: a second stops at once
            _signal_self(signal.SIGINT)
    with interrupts.graceful(announce=False):
        assert interrupts.requested() is None  # each run starts with none


def test_a_sigterm_before_the_process_group_wait_ends_the_process_there():
    """A SIGTERM that came while the run was starting (imports, its data), before it waits for its
    process group: the wait may never end (its peer never comes), so it ends the process as one
    during the wait does, not after the group's timeout (a process outlived its test so)."""
    code = ("import os, signal, time\n"
            "from xtrainer.launch import interrupts\n"
            "with interrupts.graceful(announce=False):\n"
            "    os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.2)\n"
            "    assert interrupts.requested() == signal.SIGTERM\n"
            "    with interrupts.ending_at_once():\n"
            "        time.sleep(30)  # the process group's wait\n")
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == -signal.SIGTERM, run.stderr[-2000:]
    assert time.monotonic() - started < 25
