"""The native strategies at four processes over gloo, on real processes and real signals:

- ``native_ddp`` and ``native_fsdp`` on 4 processes end bitwise equal to one process trained on
  the same global batches, and to the loop of PyTorch's DDP tutorial written by hand
  (``hand_ddp_run.py``: ``torch.multiprocessing``, a gloo process group, ``DistributedDataParallel``,
  SGD; no xtrainer);
- an FSDP2 checkpoint written by 4 processes resumes on 2, and one of 2 on 4, and training goes on
  exactly as a run that never changed size;
- two torchrun "nodes" of two processes each on one c10d rendezvous make one run folder and one
  checkpoint holding all four ranks' shards; a SIGTERM to both launchers mid-fit stops all four
  processes at one step, each exits 143, and the run resumes from ``last`` bitwise.

The module and data are ``native_run.py``'s (exact in float64: runs of different world sizes
compare bitwise). This file imports nothing of torch_xla.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import hand_ddp_run
from conftest import subprocess_timeout
import native_run
from test_native import HERE, STEPS, _assert_bitwise, _env, _script, _torchrun, _weights

pytestmark = [pytest.mark.slow, pytest.mark.multi_device]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process, whole global batches of 8: the reference."""
    trainer, model = native_run.fit("native", 1, str(tmp_path_factory.mktemp("one")), STEPS, 8)
    assert trainer.global_step == STEPS
    _EPOCH_LOSS["one"] = float(trainer.callback_metrics["train_loss_epoch"])
    return _weights(model)


_EPOCH_LOSS: dict[str, float] = {}  # the one-process run's train_loss_epoch, beside its weights


@pytest.fixture(scope="module")
def hand_ddp(tmp_path_factory):
    """The DDP tutorial's loop on 4 processes, global batches of 8 (2 per process); its weights
    under ``ExactNet``'s names."""
    out = tmp_path_factory.mktemp("hand") / "hand.pt"
    run = subprocess.run([sys.executable, os.path.join(HERE, "hand_ddp_run.py"), "--world-size", "4", "--steps",
                          str(STEPS), "--global-batch", "8", "--out", str(out)],
                         env=_env(), capture_output=True, text=True, timeout=subprocess_timeout(300))
    assert run.returncode == 0, run.stderr[-3000:]
    return {f"block.{name}": tensor for name, tensor in torch.load(out).items()}


def _shards(checkpoint: str) -> list[str]:
    return sorted(os.listdir(os.path.join(os.path.realpath(checkpoint), "state")))


def _four_shards() -> list[str]:
    return [".metadata"] + [f"__{rank}_0.distcp" for rank in range(4)]


def test_the_hand_loop_trains_the_same_model_on_the_same_data_as_one_process(one_process, hand_ddp):
    """The hand-written loop rebuilds native_run's model and data from plain torch: the same
    tensors, and (4 processes against 1) the same final weights, so the comparisons below hold
    xtrainer to an independent loop."""
    ours, theirs = native_run.make_data().tensors, hand_ddp_run.make_data().tensors
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    _assert_bitwise(hand_ddp, one_process)
    start = native_run.ExactNet().state_dict()
    assert any(not torch.equal(start[k], hand_ddp[k]) for k in start)  # the weights moved


@pytest.mark.parametrize("strategy", ["native_ddp", "native_fsdp"])
def test_four_processes_end_bitwise_equal_to_one_and_to_the_hand_written_ddp_loop(tmp_path, one_process, hand_ddp,
                                                                                 strategy):
    trainer, model = native_run.fit(strategy, 4, str(tmp_path), STEPS, 8)
    assert trainer.global_step == STEPS and trainer.world_size == 4
    weights = _weights(model)
    _assert_bitwise(weights, one_process)
    _assert_bitwise(weights, hand_ddp)
    steps = sorted(open(p).read() for p in glob.glob(str(tmp_path / "rank-*.step")))
    assert steps == [str(STEPS)] * 4  # four real processes, each at the same step
    if strategy == "native_fsdp":  # each process wrote its own shards into one checkpoint
        assert _shards(str(tmp_path / "version_0" / "checkpoints" / "last.ckpt")) == _four_shards()


@pytest.mark.parametrize("first, then", [(4, 2), (2, 4)], ids=["4-then-2", "2-then-4"])
def test_fsdp_checkpoint_of_one_world_size_resumes_exactly_at_another(tmp_path, one_process, first, then):
    """A checkpoint of step 2 (momentum buffers sharded in it) written by ``first`` processes,
    resumed by ``then`` with the same global batch: the end is the weights of a run that never
    changed size (one process, and, by the test above, four)."""
    root = str(tmp_path)
    native_run.fit("native_fsdp", first, root, STEPS // 2, 8)
    [checkpoint] = glob.glob(os.path.join(root, "version_0", "checkpoints", "epoch=0-step=2.ckpt"))
    assert _shards(checkpoint) == [".metadata"] + [f"__{rank}_0.distcp" for rank in range(first)]
    trainer, model = native_run.fit("native_fsdp", then, root, STEPS, 8, ckpt_path="last")
    assert trainer.global_step == STEPS and trainer.world_size == then
    assert trainer.ckpt_path.endswith("epoch=0-step=2.ckpt")
    _assert_bitwise(_weights(model), one_process)
    # The epoch's value covers the batches trained before the checkpoint too (by the other count of processes).
    assert float(trainer.callback_metrics["train_loss_epoch"]) == pytest.approx(_EPOCH_LOSS["one"], rel=1e-5)


def _two_nodes(root, endpoint: str, rdzv_id: str, *args: str) -> list[subprocess.Popen]:
    """Two torchrun commands of two processes each (two "nodes" on localhost), one c10d rendezvous."""
    script = [os.path.join(HERE, "native_exit_run.py"), "--strategy", "native_fsdp", "--root", str(root), *args]
    return [subprocess.Popen(_torchrun("--nnodes=2", "--nproc_per_node=2", "--rdzv-backend=c10d",
                                       f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}", *script),
                             env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]


def test_two_torchrun_nodes_of_two_stop_at_one_step_on_sigterm_and_resume_bitwise(tmp_path):
    from xtrainer.strategies.launchers.processes import free_port

    steps = "24"
    common = ["--steps", steps, "--out", str(tmp_path / "out.pt")]
    reference = _script("--strategy", "native_fsdp", "--devices", "4", "--steps", steps, "--root",
                        str(tmp_path / "ref"), "--out", str(tmp_path / "ref.pt"), timeout=400)
    assert reference.returncode == 0, reference.stderr[-3000:]

    root, ready = tmp_path / "run", tmp_path / "ready"
    root.mkdir()
    nodes = _two_nodes(root, f"127.0.0.1:{free_port()}", "scale-stop", *common, "--pause", "0.3",
                       "--ready", str(ready))
    deadline = time.monotonic() + subprocess_timeout(240)
    while not ready.exists() and all(n.poll() is None for n in nodes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ready.exists(), [n.poll() for n in nodes]
    for node in nodes:  # what a cluster does to each host's launcher
        node.send_signal(signal.SIGTERM)
    errs = [node.communicate(timeout=subprocess_timeout(120))[1] for node in nodes]
    # Each worker stopped on the signal and exited 128 + SIGTERM. (torchrun itself ends with 1:
    # it re-raises the signal as a SignalException, whatever its workers returned.)
    exits = {os.path.basename(p): open(p).read() for p in glob.glob(str(root / "rank-*.exit"))}
    assert exits == {f"rank-{r}.exit": "143" for r in range(4)}, (exits, errs[0][-3000:], errs[1][-3000:])
    assert all(node.returncode != 0 for node in nodes)
    stopped = {open(p).read() for p in glob.glob(str(root / "rank-*.step"))}
    assert len(glob.glob(str(root / "rank-*.step"))) == 4 and len(stopped) == 1, stopped  # all four, at one step
    stop_step = int(stopped.pop())
    assert 3 <= stop_step < int(steps)
    # One run folder (rank 0's), and one checkpoint of the stop holding every rank's shards.
    [folder] = glob.glob(str(root / "version_*"))
    last = os.path.realpath(os.path.join(folder, "checkpoints", "last.ckpt"))
    assert f"step={stop_step}" in os.path.basename(last), last
    assert _shards(last) == _four_shards()

    for path in glob.glob(str(root / "rank-*")):
        os.remove(path)
    nodes = _two_nodes(root, f"127.0.0.1:{free_port()}", "scale-resume", *common, "--ckpt", "last")
    errs = [node.communicate(timeout=subprocess_timeout(400))[1] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], (errs[0][-3000:], errs[1][-3000:])
    assert sorted(open(p).read() for p in glob.glob(str(root / "rank-*.exit"))) == ["0"] * 4
    a, b = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "out.pt")
    assert a["global_step"] == b["global_step"] == int(steps) and b["world_size"] == 4
    _assert_bitwise(a["weights"], b["weights"])
