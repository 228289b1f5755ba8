"""The native strategies with the rest of the Trainer: gradient clipping over FSDP2's sharded
gradients, manual optimization, checkpoints that move between the native strategies, and the
examples from the command line under ``native_ddp``, on real processes over gloo.

As in ``test_native.py``, the module and data are ``native_run.py``'s (float64, dyadic: every sum
of a step is exact), so that runs of different world sizes compare bitwise. This file imports
nothing of torch_xla: it also runs where torch_xla is not installed.
"""

from __future__ import annotations

import getpass
import glob
import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings

import conftest
import pytest
import torch

import native_run
from conftest import subprocess_timeout
from xtrainer import XModule
from xtrainer.launch.hang_monitor import EXIT_CODE as HANG_EXIT_CODE
from test_native import STEPS, _assert_bitwise, _env, _paused_run, _reference, _resumed_bitwise, _script, _weights

HERE = os.path.dirname(os.path.abspath(conftest.__file__))
ROOT = os.path.dirname(HERE)
STEPS = 4


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process, whole global batches, no clipping: the reference."""
    _, model = native_run.fit("native", 1, str(tmp_path_factory.mktemp("one")), STEPS, 8)
    return _weights(model)


def _fsdp_units(**kwargs):
    from xtrainer.strategies import NativeFSDP

    return NativeFSDP(auto_wrap_policy={native_run.Block}, **kwargs)


def _differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(a[name], b[name]) for name in a)


# ---------------------------------------------------------------------------------------------
# Gradient clipping.
# ---------------------------------------------------------------------------------------------
def test_the_native_norm_clip_is_torch_clip_grad_norm():
    """One process: the native strategies' clip (the norm summed once over every element) gives
    what ``torch.nn.utils.clip_grad_norm_`` gives, up to rounding, and clips by value as it does."""
    from xtrainer.strategies import NativeSingle

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in [(3, 5), (7,), (2, 2, 2)]]
    for algorithm, value in [("norm", 0.7), ("norm", 100.0), ("value", 0.3)]:
        theirs = [torch.nn.Parameter(p.detach().clone()) for p in params]
        original = []
        for p, q in zip(params, theirs):
            p.grad = torch.randn_like(p) * 2
            q.grad = p.grad.clone()
            original.append(p.grad.clone())
        NativeSingle().clip_gradients(None, torch.optim.SGD(params, lr=0.1), value, algorithm)
        if algorithm == "norm":
            torch.nn.utils.clip_grad_norm_(theirs, value)
        else:
            torch.nn.utils.clip_grad_value_(theirs, value)
        for p, q in zip(params, theirs):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
        clipped = any(not torch.equal(p.grad, g) for p, g in zip(params, original))
        assert clipped == (value != 100.0)  # a norm under the limit is left alone


def test_the_norm_clip_multiplies_each_dtype_at_once_with_the_bits_of_one_multiply_per_tensor():
    """The gradients of each dtype are scaled by one foreach multiply (not one ``mul_`` per
    tensor), with the same bits as multiplying each by the coefficient in its dtype."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from xtrainer.strategies import NativeSingle
    from xtrainer.strategies.dtensors import gradient_norm

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    dtypes = [torch.float32, torch.float64, torch.float32, torch.bfloat16, torch.float64, torch.float32]
    params = [torch.nn.Parameter(torch.randn(3, 4 + i, dtype=dtype)) for i, dtype in enumerate(dtypes)]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    grads = [p.grad.clone() for p in params]
    coefficient = torch.clamp(0.5 / (gradient_norm(grads, grads) + 1e-6), max=1.0)
    expected = [g.mul_(coefficient.to(g.dtype)) for g in grads]  # one multiply per tensor
    with Ops() as ops:
        NativeSingle().clip_gradients(None, torch.optim.SGD(params, lr=0.1), 0.5, "norm")
    assert ops.names.count("_foreach_mul_") == 3 and "mul_" not in ops.names, ops.names
    for p, e in zip(params, expected):
        assert p.grad.dtype == e.dtype and torch.equal(p.grad, e)


@pytest.mark.multi_device
def test_fsdp_accumulating_micro_batches_clips_the_sum(tmp_path):
    """Two micro-batches per step under native_fsdp (gradient sync off for the first), clipped by
    value: as one process on the whole global batch."""
    clip = {"gradient_clip_val": 1 / 8, "gradient_clip_algorithm": "value"}
    _, single = native_run.fit("native", 1, str(tmp_path / "one"), STEPS, 8, **clip)
    _, sharded = native_run.fit("native_fsdp", 2, str(tmp_path / "two"), STEPS, 4, accumulate_grad_batches=2, **clip)
    _assert_bitwise(_weights(sharded), _weights(single))


@pytest.mark.multi_device
@pytest.mark.parametrize("algorithm, value, steps, units", [("norm", 0.5, 1, False), ("value", 1 / 8, STEPS, False),
                                                            ("norm", 0.5, 1, True)],
                         ids=["norm", "value", "norm-units"])
def test_fsdp_clips_by_the_whole_gradient_as_one_process_does(tmp_path, one_process, algorithm, value, steps, units):
    """Two processes, each holding half of every gradient (DTensors): the clip is by the norm of
    the whole gradient (all shards), so the step equals one process's clipped step bitwise. By
    norm, one step: the clipped weights are no longer dyadic, and later steps' sums round
    differently when the batch is split. By value, the weights stay exact for every step."""
    clip = {"gradient_clip_val": value, "gradient_clip_algorithm": algorithm}
    _, single = native_run.fit("native", 1, str(tmp_path / "one"), steps, 8, **clip)
    strategy = _fsdp_units() if units else "native_fsdp"  # a unit of its own, or the root's parameters
    _, sharded = native_run.fit(strategy, 2, str(tmp_path / "two"), steps, 8, **clip)
    _assert_bitwise(_weights(sharded), _weights(single))
    if steps == STEPS:
        assert _differs(_weights(single), one_process)  # the clip clipped
    else:
        _, unclipped = native_run.fit("native", 1, str(tmp_path / "plain"), steps, 8)
        assert _differs(_weights(single), _weights(unclipped))


# ---------------------------------------------------------------------------------------------
# Manual optimization.
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def manual_one_process(tmp_path_factory):
    trainer, model = native_run.fit("native", 1, str(tmp_path_factory.mktemp("manual")), 2 * STEPS, 8,
                                    model=native_run.ManualNet())
    assert trainer.global_step == 2 * STEPS  # every opt.step() counts
    return _weights(model)


@pytest.mark.multi_device
@pytest.mark.parametrize("strategy", ["native_ddp", "native_fsdp", "units", "units+checkpointing"])
def test_manual_optimization_on_two_processes_equals_one(tmp_path, manual_one_process, one_process, strategy):
    """Two optimizers, two backward passes per batch, a clip: as one process on the same batches.
    FSDP2 with the root's parameters only, and with a unit of its own (activations recomputed)."""
    assert _differs(manual_one_process, one_process)
    if strategy.startswith("units"):
        strategy = _fsdp_units(activation_checkpointing=strategy.endswith("checkpointing"))
    trainer, model = native_run.fit(strategy, 2, str(tmp_path), 2 * STEPS, 8, model=native_run.ManualNet())
    assert trainer.global_step == 2 * STEPS
    _assert_bitwise(_weights(model), manual_one_process)


@pytest.mark.multi_device
def test_lightnings_one_optimizer_manual_loop_on_two_ddp_processes_equals_automatic_optimization(tmp_path,
                                                                                                 one_process):
    """zero_grad, manual_backward, step: the backward runs inside DDP's forward, whose end arms
    the reducer again; the second batch's forward used to fail on DDP's bucket rebuild."""
    trainer, model = native_run.fit("native_ddp", 2, str(tmp_path), STEPS, 8, model=native_run.OneOptimizerManualNet())
    assert trainer.global_step == STEPS
    _assert_bitwise(_weights(model), one_process)


# ---------------------------------------------------------------------------------------------
# Checkpoints from one native strategy resumed by another.
# ---------------------------------------------------------------------------------------------
@pytest.mark.multi_device
@pytest.mark.parametrize("first, then", [(("native_ddp", 2), ("native_fsdp", 2)), (("native", 1), ("native_fsdp", 2)),
                                         (("native_fsdp", 2), ("native", 1)), (("native_fsdp", 2), ("native_ddp", 2))],
                         ids=["ddp2-to-fsdp2", "native-to-fsdp2", "fsdp2-to-native", "fsdp2-to-ddp2"])
def test_a_checkpoint_resumes_under_another_native_strategy(tmp_path, one_process, first, then):
    """A whole file (native, native_ddp) resumed sharded by native_fsdp, and native_fsdp's sharded
    folder resumed whole: the run goes on exactly as one that never changed strategy (momentum
    included), on the same global batches."""
    root = str(tmp_path)
    native_run.fit(first[0], first[1], root, STEPS // 2, 8)
    written = os.path.realpath(os.path.join(root, "version_0", "checkpoints", "last.ckpt"))
    assert os.path.isdir(written) == (first[0] == "native_fsdp")
    trainer, model = native_run.fit(then[0], then[1], root, STEPS, 8, ckpt_path="last")
    assert trainer.global_step == STEPS
    assert os.path.realpath(trainer.ckpt_path) == written
    _assert_bitwise(_weights(model), one_process)


# ---------------------------------------------------------------------------------------------
# Attacks.
# ---------------------------------------------------------------------------------------------
@pytest.mark.multi_device
def test_sigterm_mid_fit_under_fsdp_with_clipping_then_resume_is_bitwise(tmp_path):
    """native_fsdp on two processes, clipping by norm (a collective in every step): a SIGTERM
    mid-epoch stops both processes at one step with a checkpoint; the resumed run ends with the
    weights of an uninterrupted one, bitwise."""
    steps = 16
    common = ["--strategy", "native_fsdp", "--devices", "2", "--steps", str(steps), "--clip", "0.5"]
    _reference(tmp_path, "native_fsdp", 2, steps, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
    process, _ = _paused_run(tmp_path, common, pause="0.3")
    time.sleep(0.4)  # a step later: not on a checkpoint's step
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=subprocess_timeout(120))
    assert process.returncode == 143, err[-3000:]
    root = tmp_path / "run"
    stopped = {open(p).read() for p in glob.glob(str(root / "rank-*.step"))}
    assert len(glob.glob(str(root / "rank-*.step"))) == 2 and len(stopped) == 1, stopped  # both, at one step
    stopped_at = int(stopped.pop())
    assert 3 <= stopped_at < steps and stopped_at % 8, stopped_at  # mid-epoch (8 steps an epoch)
    assert not (tmp_path / "out.pt").exists()
    resumed = _resumed_bitwise(tmp_path, common, steps)
    assert f"step={stopped_at}" in resumed.stdout + resumed.stderr  # resumed from the stop's checkpoint


@pytest.mark.multi_device
@pytest.mark.parametrize("first, then", [(("native_fsdp", 2), ("native", 1)), (("native_ddp", 2), ("native_fsdp", 2))],
                         ids=["fsdp2-to-native", "ddp2-to-fsdp2"])
def test_adam_state_moves_between_native_strategies(tmp_path, first, then):
    """Adam's state (a scalar step count beside the sharded moments) survives the move both ways:
    the resumed run follows an uninterrupted one (to rounding: Adam's square roots make the
    weights inexact, and the batch is summed in other orders)."""
    _, reference = native_run.fit("native", 1, str(tmp_path / "ref"), STEPS, 8, model=native_run.AdamNet())
    root = str(tmp_path / "run")
    native_run.fit(first[0], first[1], root, STEPS // 2, 8, model=native_run.AdamNet())
    trainer, model = native_run.fit(then[0], then[1], root, STEPS, 8, ckpt_path="last", model=native_run.AdamNet())
    assert trainer.global_step == STEPS and trainer.ckpt_path.endswith("step=2.ckpt")
    for name, value in _weights(reference).items():
        torch.testing.assert_close(_weights(model)[name], value, rtol=1e-12, atol=0)


@pytest.mark.multi_device
def test_evaluation_data_padded_for_the_replicas_is_said(tmp_path, capfd):
    """33 validation samples over two processes: the sampler repeats one, and the run says that
    the stage's values count it twice; 32 samples divide evenly and say nothing."""
    from torch.utils.data import DataLoader

    from xtrainer import Trainer

    for samples in (33, 32):
        trainer = Trainer(strategy="native_ddp", devices=2, accelerator="cpu", max_steps=2, logger=False,
                          default_root_dir=str(tmp_path), enable_progress_bar=False, enable_model_summary=False,
                          num_sanity_val_steps=0)
        with warnings.catch_warnings(record=True) as caught:  # rank 0 warns in this process
            warnings.simplefilter("always")
            trainer.fit(native_run.ExactNet(), DataLoader(native_run.make_data(16), batch_size=4),
                        DataLoader(native_run.make_data(samples), batch_size=4))
        err = "\n".join([capfd.readouterr().err, *(str(w.message) for w in caught)])
        said = ("validate: the 33 samples are dealt to 2 replicas by a DistributedSampler, which repeats 1 of them "
                "so that every replica gets as many batches (as in Lightning): this stage's values count those twice")
        assert (said in err) == (samples == 33), err[-2000:]


@pytest.mark.multi_device
def test_a_replica_stuck_while_the_other_waits_in_a_collective_is_ended_by_the_hang_watchdog(tmp_path):
    """``xtrainer fit`` on 2 real processes: rank 1 stops stepping, rank 0 waits for it in gloo.
    Each process's monitor writes its stacks and ends it; the command says the watchdog ended the
    run, how to resume, and exits with the watchdog's code, as a one-process run would."""
    exe = os.path.join(os.path.dirname(sys.executable), "xtrainer")
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  _target_: conftest.Regressor\ndata:\n  _target_: conftest.RegressionData\n"
                      "  batch_size: 4\n")
    started = time.monotonic()
    run = subprocess.run([exe, "fit", "--config", str(config), "trainer.strategy=native_ddp", "trainer.devices=2",
                          "trainer.accelerator=cpu", "trainer.max_steps=12", "trainer.logger=false",
                          "trainer.enable_checkpointing=false", "trainer.enable_progress_bar=false",
                          f"trainer.default_root_dir={tmp_path}", "trainer.hang_timeout=6", "trainer.exit_on_hang=true",
                          "callbacks=[{_target_: native_run.SleepOnRankOne}]"],
                         cwd=os.path.dirname(os.path.abspath(conftest.__file__)), env=_env(), capture_output=True,
                         text=True,
                         timeout=subprocess_timeout(300))
    assert run.returncode == HANG_EXIT_CODE, run.stderr[-3000:]
    assert time.monotonic() - started < 120
    assert "ended by the hang watchdog" in run.stderr and "ckpt_path='last'" in run.stderr
    reports = sorted(glob.glob(str(tmp_path / "version_0" / "hang-*.txt")))
    assert any("in on_train_batch_start" in open(path).read() for path in reports), run.stderr[-3000:]  # rank 1's sleep


@pytest.mark.multi_device
def test_the_processes_of_devices_2_run_no_python_thread_of_ours(tmp_path):
    """Rank 0 of ``devices=2`` runs in the caller, rank 1 in a process that ends with its caller
    through the parent-death signal, not a watching thread; the caller watches rank 1 without
    one either. A second thread costs every step (glibc's locks and allocator leave their
    single-threaded paths, and its wake-ups take the GIL). gloo's threads are C++ threads."""
    threads = native_run.Threads(str(tmp_path))
    before = sorted(t.name for t in threading.enumerate())
    trainer, _ = native_run.fit("native_ddp", 2, str(tmp_path), STEPS, 8, callbacks=[threads])
    assert trainer.global_step == STEPS
    assert threads.pid == os.getpid() and threads.names == before  # rank 0 ran here, beside no thread of ours
    pids, *names = (tmp_path / "threads-1.txt").read_text().splitlines()
    assert int(pids.split()[1]) == os.getpid()  # rank 1 ran in a process of this caller's
    assert names == ["MainThread"], names


@pytest.mark.multi_device
def test_the_pickled_job_is_not_kept_while_the_processes_of_devices_2_train(tmp_path):
    """The job (trainer, module, callbacks, dataloaders) reaches each process of ``devices=2`` as
    pickled bytes as large as itself (with an in-memory dataset, as large as the data). Neither a
    process nor the caller keeps those bytes while training: that was a second copy of the data
    in every process, for the whole run."""
    size = 32 * 2**20
    ballast = native_run.Ballast(size)  # 32 MiB that travel with the job, as a dataset would
    ready, held_by_caller = str(tmp_path / "ready"), []

    def look_in_the_caller():  # while the processes train (rank 0 writes READY after step 3)
        deadline = time.monotonic() + subprocess_timeout(120)
        while not os.path.exists(ready) and time.monotonic() < deadline:
            time.sleep(0.05)
        held_by_caller.append(native_run.largest_bytes_held(exclude=ballast.ballast))

    looking = threading.Thread(target=look_in_the_caller, daemon=True)
    looking.start()
    trainer, _ = native_run.fit("native_ddp", 2, str(tmp_path), 8, 8, pause=0.3, ready=ready, callbacks=[ballast])
    looking.join(timeout=subprocess_timeout(60))
    assert trainer.global_step == 8 and os.path.exists(ready)
    assert ballast.held is not None and ballast.held < size // 2, ballast.held  # rank 0's process, mid-fit
    assert held_by_caller and held_by_caller[0] < size // 2, held_by_caller


@pytest.mark.multi_device
def test_the_processes_of_devices_2_rebuild_tensors_without_backward_hooks_and_share_the_cores(tmp_path,
                                                                                                  monkeypatch):
    """torch's unpickling gives every tensor an empty dict of backward hooks: on a parameter a
    hook called in every backward pass, on a dataset's tensor autograd state that slows every
    sample taken from it. The job's tensors are rebuilt in each process without them, as the
    caller's own tensors are. And the processes share the cores: torch's default of one
    intra-op thread per core in each would run two threads per core."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    facts = native_run.ProcessFacts()
    trainer, model = native_run.fit("native_ddp", 2, str(tmp_path), 4, 8, callbacks=[facts])
    assert trainer.global_step == 4
    cores = len(os.sched_getaffinity(0))
    assert facts.seen == {"parameters": [None] * len(list(model.parameters())), "data": [None, None],
                          "threads": max(1, cores // 2)}, facts.seen


def test_the_intra_op_threads_of_devices_n_are_the_users_where_set(monkeypatch):
    """OMP_NUM_THREADS, where set, is the user's: the processes inherit it untouched."""
    from xtrainer.strategies.launchers import native_processes

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert native_processes._intra_op_threads(2) == {}
    monkeypatch.delenv("OMP_NUM_THREADS")
    cores = len(os.sched_getaffinity(0))
    assert native_processes._intra_op_threads(2 * cores) == {"OMP_NUM_THREADS": "1"}
    assert native_processes._intra_op_threads(1) == {"OMP_NUM_THREADS": str(cores)}


def test_more_processes_than_the_hosts_devices_are_refused_with_what_to_do(monkeypatch):
    """devices=3 on a host with two devices of the kind (or torchrun starting three there) is
    refused before any process starts. The device count is the one thing mocked: this host has
    no accelerator."""
    from xtrainer.runtimes import EagerRuntime
    from xtrainer.strategies import native
    from xtrainer.strategies.launchers.processes import free_port

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    strategy = native.NativeDDP()
    strategy.runtime = EagerRuntime("cuda")
    monkeypatch.setattr(strategy.runtime, "local_device_count", lambda: 2)
    assert strategy._resolve_devices(2) == 2
    assert strategy._resolve_devices("auto") == 2
    with pytest.raises(ValueError, match=r"devices=3, but this host has 2 cuda device\(s\): start 2 or fewer"):
        strategy._resolve_devices(3)
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # never bound here; never the default either
    with pytest.raises(ValueError, match="torchrun started 3 processes on this host, but this host has 2 cuda"):
        strategy._resolve_devices("auto")
    strategy.runtime = EagerRuntime("cpu")
    assert strategy._resolve_devices("auto") == 6


@pytest.mark.multi_device
def test_a_replica_killed_by_sigkill_is_named_and_the_run_resumes(tmp_path):
    """SIGKILL to replica 1's process (what the out-of-memory killer sends): the error names that
    replica and the signal, not the lost connection replica 0 then met; the run resumes from its
    last checkpoint and ends as an uninterrupted one, bitwise."""
    steps = 16
    common = ["--strategy", "native_ddp", "--devices", "2", "--steps", str(steps)]
    _reference(tmp_path, "native_ddp", 2, steps)
    process, rank1 = _paused_run(tmp_path, common, wait_for="ready-1", pause="0.3")
    time.sleep(0.2)
    os.kill(int(rank1.read_text()), signal.SIGKILL)
    _, err = process.communicate(timeout=subprocess_timeout(120))
    assert process.returncode == 1, err[-3000:]
    assert "RuntimeError: Rank 1's process was ended by SIGKILL (signal 9): SIGKILL comes from outside the " \
           "process: most often the kernel's out-of-memory killer" in err, err[-3000:]
    _resumed_bitwise(tmp_path, common, steps)


@pytest.mark.multi_device
def test_a_module_class_the_new_processes_cannot_import_is_named_with_what_to_do(tmp_path):
    """A class defined under ``if __name__ == "__main__":`` cannot be rebuilt in the replicas'
    processes (they import the script as a module): the error says so, with unpickling's own words."""
    script = tmp_path / "guarded.py"
    script.write_text(
        "import torch\n"
        "from torch.utils.data import DataLoader\n"
        "import native_run\n"
        "from xtrainer import Trainer\n"
        "if __name__ == '__main__':\n"
        "    class Local(native_run.ExactNet):\n"
        "        pass\n"
        "    trainer = Trainer(strategy='native_ddp', devices=2, accelerator='cpu', max_steps=2, logger=False,\n"
        f"                      default_root_dir={str(tmp_path)!r}, enable_progress_bar=False)\n"
        "    trainer.fit(Local(), DataLoader(native_run.make_data(16), batch_size=4))\n")
    done = subprocess.run([sys.executable, str(script)], env=_env(), capture_output=True, text=True, timeout=subprocess_timeout(300))
    assert done.returncode == 1
    assert ("RuntimeError: Trainer(devices=2): a new process could not rebuild what it was sent (the trainer, the "
            "module, the callbacks and the dataloaders, pickled): AttributeError: Can't get attribute 'Local'") \
        in done.stderr, done.stderr[-3000:]
    assert "without reporting an error" not in done.stderr


@pytest.mark.multi_device
@pytest.mark.parametrize("strategy", ["native_fsdp", "units"])
def test_toggled_optimizers_under_fsdp_on_two_processes_equal_one(tmp_path, strategy):
    """Lightning's GAN recipe (each optimizer's pass between toggle_optimizer and
    untoggle_optimizer) under FSDP2 on two processes: as one process. The root's parameters are
    gathered again after each step, while the other optimizer's are still switched off: the
    toggle must reach the gathered copies."""
    _, one = native_run.fit("native", 1, str(tmp_path / "one"), 2 * STEPS, 8, model=native_run.ToggledNet())
    trainer, model = native_run.fit(_fsdp_units() if strategy == "units" else strategy, 2, str(tmp_path / "two"),
                                    2 * STEPS, 8, model=native_run.ToggledNet())
    assert trainer.global_step == 2 * STEPS
    _assert_bitwise(_weights(model), _weights(one))
    assert all(p.requires_grad for p in model.parameters())  # untoggled


@pytest.mark.multi_device
def test_manual_optimization_under_fsdp_resumes_exactly(tmp_path, manual_one_process):
    """The checkpoint of a manual fit under native_fsdp (written while the root's parameters are
    gathered after the step) resumes on two processes and ends as one process does."""
    root = str(tmp_path)
    native_run.fit("native_fsdp", 2, root, STEPS, 8, model=native_run.ManualNet(), every_n_train_steps=4)
    trainer, model = native_run.fit("native_fsdp", 2, root, 2 * STEPS, 8, ckpt_path="last",
                                    model=native_run.ManualNet())
    assert trainer.ckpt_path.endswith("step=4.ckpt") and trainer.global_step == 2 * STEPS
    _assert_bitwise(_weights(model), manual_one_process)


def _ddp(agreement_seconds: float):
    from xtrainer.strategies import NativeDDP

    return NativeDDP(agreement_seconds=agreement_seconds)


@pytest.mark.multi_device
def test_a_logging_step_does_not_wait_for_the_other_process_and_a_stop_is_still_taken_together(tmp_path):
    """Rank 1 holds back its read of logging step 2 until rank 0 has finished step 2: with the
    stop vote as a blocking all-reduce, rank 0 would wait there for rank 1 and neither would go
    on. Then rank 1 alone sets should_stop after step 5: with an agreement at every logging step
    (``agreement_seconds=0``), the next one (6) starts the vote, settled after the next batch, so
    both stop after step 7 (one stopping alone would leave the other waiting in DDP's all-reduce)."""
    model = native_run.AheadNet(str(tmp_path), at=2, stop_at=5)
    trainer, _ = native_run.fit(_ddp(0), 2, str(tmp_path / "run"), 16, 8, model=model, every_n_train_steps=100)
    assert trainer.global_step == 7


@pytest.mark.multi_device
@pytest.mark.parametrize("seconds", [3600, float("inf")])
def test_spaced_agreements_still_stop_both_processes_together(tmp_path, seconds):
    """With agreements an hour (or forever) apart, the logging steps after the first two start
    none (the second settles the next one's step an hour of steps on): rank 1's stop after step 5
    is shared only at the epoch's end, which always agrees, and both stop there, after step 8
    (epochs of 8 batches), not hanging in DDP's all-reduce."""
    model = native_run.AheadNet(str(tmp_path), at=2, stop_at=5)
    trainer, _ = native_run.fit(_ddp(seconds), 2, str(tmp_path / "run"), 16, 8, model=model, every_n_train_steps=100)
    assert trainer.global_step == 8


@pytest.mark.multi_device
def test_a_nan_loss_on_one_process_stops_both_at_the_step_it_happened(tmp_path):
    # Two processes, batches of 4 each: sample 21 is rank 1's (every other sample), in its batch
    # 2, so in global step 2; rank 0's losses are all finite. The read of step 4 starts one
    # all-reduce that also carries the stop vote; both learn of it when it is settled, after the
    # next batch (step 5).
    with pytest.raises(FloatingPointError, match=r"NaN or infinite at global step 2 .*step 5 now"):
        native_run.fit(_ddp(0), 2, str(tmp_path), 8, 8, nan_at=21, log_every_n_steps=4, every_n_train_steps=100)


@pytest.mark.multi_device
@pytest.mark.parametrize("seconds, now", [(0, 7), (3600, 8)])
def test_a_nan_loss_between_spaced_agreements_is_reported_at_the_next_one(tmp_path, seconds, now):
    """Sample 53 is rank 1's, in its batch 6 (global step 6). Logging every 2 steps, with an
    agreement at each one (0 s) it is reported one batch after the read of step 6; with them an
    hour apart, only the reads of steps 2 and 4 start one, and the epoch's end (after step 8)
    reports it: late, but with the step it happened at."""
    with pytest.raises(FloatingPointError, match=rf"NaN or infinite at global step 6 .*step {now} now"):
        native_run.fit(_ddp(seconds), 2, str(tmp_path), 16, 8, nan_at=53, log_every_n_steps=2, every_n_train_steps=100)


# ---------------------------------------------------------------------------------------------
# Random ops in the step.
# ---------------------------------------------------------------------------------------------
class _DropoutNet(native_run.ExactNet):
    """Dropout before the layer: on the CPU it draws from torch's global generator, the one the
    loader drew its workers' base seed from when the epoch's iterator started."""

    def forward(self, x):
        return super().forward(torch.nn.functional.dropout(x, 0.5, self.training))


@pytest.mark.parametrize("strategy, devices", [("native", 1), pytest.param("native_ddp", 2, marks=pytest.mark.multi_device)])
def test_a_run_with_dropout_resumed_inside_a_shuffled_epoch_is_bitwise(tmp_path, strategy, devices):
    """A shuffled loader (the strategy puts its own sampler in) and dropout in the step: resumed
    from a checkpoint inside the epoch, the run ends with the weights of an uninterrupted one,
    bitwise. Starting the resumed epoch's iterator must not draw from the generator dropout uses."""
    from torch.utils.data import DataLoader

    from xtrainer import Trainer, seed_everything

    def fit(root: str, steps: int, ckpt_path: str | None = None):
        seed_everything(7)
        model = _DropoutNet()
        trainer = Trainer(strategy=strategy, devices=devices, accelerator="cpu", max_steps=steps, max_epochs=-1,
                          default_root_dir=root, enable_progress_bar=False, enable_model_summary=False,
                          log_every_n_steps=2, logger=False)
        loader = DataLoader(native_run.make_data(64), batch_size=8 // devices, shuffle=True)
        trainer.fit(model, loader, ckpt_path=ckpt_path)
        return trainer, _weights(model)

    _, reference = fit(str(tmp_path / "ref"), 6)
    fit(str(tmp_path / "run"), 3)  # stops inside the first epoch of 8 batches, with a checkpoint
    trainer, resumed = fit(str(tmp_path / "run"), 6, ckpt_path="last")
    assert trainer.global_step == 6
    _assert_bitwise(resumed, reference)


# ---------------------------------------------------------------------------------------------
# Gradients cleared after each optimizer step.
# ---------------------------------------------------------------------------------------------
class _PartlyOptimized(XModule):
    """Two layers, one optimized (``optimizer`` over ``trained``'s parameters), one left out of
    the optimizer but still taking gradients: torch's ``zero_grad`` clears only the former."""

    def __init__(self, optimizer: type = torch.optim.SGD) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trained, self.left_out = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.left_out(self.trained(x)).square().mean()

    def configure_optimizers(self):
        return self.optimizer(self.trained.parameters(), lr=0.1)


class _CountingSGD(torch.optim.SGD):
    """An optimizer with a ``zero_grad`` of its own, which must be the one called."""

    calls: list = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.calls.append(set_to_none)
        super().zero_grad(set_to_none)


def _loader(data: torch.Tensor) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=2)


def _clearing_fit(tmp_path, module: XModule, data: torch.Tensor, profile: bool = False) -> list[str]:
    """Fit ``module`` on ``data`` (batches of 2) under ``native``; under torch's profiler with
    ``profile``: the names of the ranges it recorded."""
    from xtrainer import Trainer
    from xtrainer.strategies import NativeSingle

    trainer = Trainer(strategy=NativeSingle(), max_epochs=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    if not profile:
        trainer.fit(module, _loader(data))
        return []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        trainer.fit(module, _loader(data))
    return [event.name for event in prof.events()]


def test_gradients_are_cleared_after_each_step_as_torch_zero_grad_clears_them(tmp_path):
    """The optimizer's parameters end each step without gradients; a parameter outside the
    optimizer keeps accumulating its own, as under ``optimizer.zero_grad(set_to_none=True)``;
    weights and kept gradients are bitwise those of a hand loop calling it."""
    data = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
    module = _PartlyOptimized()
    _clearing_fit(tmp_path, module, data)
    hand = _PartlyOptimized()
    optimizer = hand.configure_optimizers()
    for batch in _loader(data):
        hand.training_step(batch, 0).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in module.trained.parameters())
    for mine, theirs in zip(module.parameters(), hand.parameters()):
        assert torch.equal(mine, theirs)
        assert (mine.grad is None and theirs.grad is None) or torch.equal(mine.grad, theirs.grad)
    assert all(p.grad is not None for p in module.left_out.parameters())


def test_an_optimizer_with_a_zero_grad_of_its_own_has_it_called(tmp_path):
    _CountingSGD.calls = []
    module = _PartlyOptimized(_CountingSGD)
    _clearing_fit(tmp_path, module, torch.randn(6, 3))
    assert _CountingSGD.calls == [True] * 4  # before each of the 3 steps' backward, and the drop after the fit


def test_under_torch_profiler_the_zero_grad_range_is_recorded(tmp_path):
    """Where the range is wanted, torch's ``zero_grad`` runs (with it); else the gradients are
    cleared without it."""
    names = _clearing_fit(tmp_path, _PartlyOptimized(), torch.randn(6, 3), profile=True)
    assert names.count("Optimizer.zero_grad#SGD.zero_grad") == 4  # 3 steps, and the drop after the fit


class _DrawsInItsSteps(XModule):
    """Draws from torch's generator in its steps, as a GAN's generator draws its noise."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.drawn = []

    def training_step(self, batch, batch_idx):
        self.drawn.append(torch.rand(3))
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_steps_on_the_cpu_go_on_from_the_hosts_generator_as_in_lightning(tmp_path):
    """One process on the CPU, where the device's generator is the host's: the steps' draws go
    on from where the module's initialisation left the generator (as in Lightning), not from
    the seed again, which would hand the steps the initialisation's numbers."""
    from torch.utils.data import DataLoader

    from xtrainer import Trainer, seed_everything

    seed_everything(7)
    module = _DrawsInItsSteps()
    after_init = torch.get_rng_state()
    Trainer(strategy="native", max_steps=2, default_root_dir=str(tmp_path), logger=False, enable_progress_bar=False,
            enable_checkpointing=False, enable_model_summary=False).fit(module, DataLoader(torch.ones(4, 3), batch_size=2))
    torch.set_rng_state(after_init)
    assert all(torch.equal(drawn, torch.rand(3)) for drawn in module.drawn)
    seed_everything(7)
    assert not torch.equal(module.drawn[0], torch.rand(3))  # what a re-seeded generator gives first


@pytest.mark.multi_device
def test_a_restart_loads_torch_compiles_graphs_from_the_runs_folder(tmp_path):
    """torch.compile's cache lives beside the runs (``<root>/inductor_cache/rank_0``), not in the
    temporary folder: each process here gets an empty temporary folder of its own, as a restart
    on a fresh machine would, and the restart still loads every graph the first run compiled.
    (Here, in the newest torch's environment only: about a minute and a half of compiling.)"""
    root, out = tmp_path / "runs", str(tmp_path / "out.pt")
    lines = []
    for i, extra in enumerate([(), ("--ckpt", "last", "--steps", str(2 * STEPS))]):
        tmp = tmp_path / f"tmp{i}"
        tmp.mkdir()
        done = _script("--strategy", "native", "--compile", "--steps", str(STEPS), "--root", str(root), "--out", out,
                       *extra, env={"TMPDIR": str(tmp), "TORCHINDUCTOR_CACHE_DIR": None}, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        lines.append(next(line for line in done.stdout.splitlines() if "compilation cache" in line))
        # no compiled graph in the temporary folder (torch keeps its precompiled C++ header there)
        assert not (tmp / f"torchinductor_{getpass.getuser()}" / "fxgraph").exists()
    cache = root / "inductor_cache" / "rank_0"
    assert cache.is_dir() and any(cache.iterdir())
    first = re.search(r"(\d+) of (\d+) graphs loaded", lines[0]).groups()
    hits, lookups = map(int, re.search(r"(\d+) of (\d+) graphs loaded", lines[1]).groups())
    assert str(cache) in lines[1] and first[0] == "0" and int(first[1]) > 0, lines
    assert hits == lookups > 0, lines  # the restart compiled nothing again
    assert torch.load(out)["global_step"] == 2 * STEPS
