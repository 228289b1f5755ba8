"""The native strategies (``native``, ``native_ddp``, ``native_fsdp``) on real processes over
gloo: several processes train exactly as one does on the same global batches, a SIGTERM stops
every process at one step and the run resumes bitwise, FSDP2 checkpoints resume at another world
size, and torchrun starts the replicas in place.

The module and data are ``native_run.py``'s: small integers and dyadic weights in float64, so
that every sum of a step is exact and runs of different world sizes can be compared bitwise (a
wrong share of the data, a gradient summed instead of averaged, a lost micro-batch: each changes
the bits). This file imports nothing of torch_xla: it also runs where torch_xla is not installed.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

import conftest
import native_run
from conftest import subprocess_timeout
from xtrainer import Trainer

HERE = os.path.dirname(os.path.abspath(conftest.__file__))
ROOT = os.path.dirname(HERE)
STEPS = 4  # exact in float64 for this many steps (the tests compare world sizes bitwise)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE, env.get("PYTHONPATH", "")])
    return env


def _script(*args: str, timeout: float = 240, env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in {**_env(), **(env or {})}.items() if v is not None}  # None: unset
    return subprocess.run([sys.executable, os.path.join(HERE, "native_run.py"), *args], env=env,
                          capture_output=True, text=True, timeout=subprocess_timeout(timeout))


def _paused_run(tmp_path, common: list[str], wait_for: str = "ready", pause: str = "0.2"
                ) -> tuple[subprocess.Popen, "os.PathLike[str]"]:
    """``native_run.py`` with ``common`` in the background, each step slowed down by ``pause``
    seconds, writing under ``tmp_path/run``; returned once ``tmp_path/wait_for`` exists (``ready``:
    rank 0 is past step 3; ``ready-R``: rank R is, the file holding its pid), with that file."""
    process = subprocess.Popen([sys.executable, os.path.join(HERE, "native_run.py"), *common, "--root",
                                str(tmp_path / "run"), "--out", str(tmp_path / "out.pt"), "--pause", pause,
                                "--ready", str(tmp_path / "ready")],
                               env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    marker = tmp_path / wait_for
    deadline = time.monotonic() + subprocess_timeout(180)
    while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), process.communicate()[1][-3000:]
    return process, marker


def _reference(tmp_path, strategy: str, devices: int, steps: int, **kwargs) -> None:
    """The uninterrupted run that ``_resumed_bitwise`` compares with, fitted in this process (rank 0
    here, the other ranks in processes of their own, as ``native_run.py`` would run them; ``kwargs``:
    the Trainer's, as its ``--clip``), saved as ``native_run.py --out`` saves it: ``tmp_path/ref.pt``."""
    trainer, model = native_run.fit(strategy, devices, str(tmp_path / "ref"), steps, 8, **kwargs)
    assert trainer.global_step == steps
    torch.save({"weights": _weights(model), "global_step": trainer.global_step}, tmp_path / "ref.pt")


def _resumed_bitwise(tmp_path, common: list[str], steps: int) -> subprocess.CompletedProcess:
    """Resume ``tmp_path/run`` from its last checkpoint; its final weights must be those of the
    uninterrupted run's ``tmp_path/ref.pt``, bitwise, at ``steps``."""
    resumed = _script(*common, "--root", str(tmp_path / "run"), "--out", str(tmp_path / "out.pt"), "--ckpt", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "out.pt")
    assert a["global_step"] == b["global_step"] == steps
    _assert_bitwise(a["weights"], b["weights"])
    return resumed


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), (name, (a[name] - b[name]).abs().max().item())


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process, whole global batches: the reference."""
    root = str(tmp_path_factory.mktemp("one"))
    trainer, model = native_run.fit("native", 1, root, STEPS, 8)
    assert trainer.global_step == STEPS
    return _weights(model)


def test_one_process_moves_the_weights(one_process):
    start = native_run.ExactNet().state_dict()
    assert any(not torch.equal(start[k], one_process[k]) for k in start)  # the comparisons below mean something


def test_compile_runs_the_forward_through_torch_compile_with_the_same_result(tmp_path, one_process):
    from xtrainer.strategies import NativeSingle

    compiles = []

    def backend(graph, example_inputs):  # torch.compile's backend: counts the graphs, runs them as traced
        compiles.append(graph)
        return graph.forward

    strategy = NativeSingle(compile=True, compile_kwargs={"backend": backend})
    trainer, model = native_run.fit(strategy, 1, str(tmp_path), STEPS, 8)
    assert compiles  # the forward went through torch.compile
    _assert_bitwise(_weights(model), one_process)


@pytest.mark.parametrize("strategy", ["native_ddp", "native_fsdp"])
def test_two_processes_end_bitwise_equal_to_one_on_the_same_global_batches(tmp_path, one_process, strategy):
    kwargs = {"accumulate_grad_batches": 2} if strategy == "native_ddp" else {}
    trainer, model = native_run.fit(strategy, 2, str(tmp_path), STEPS, 8 // (2 if kwargs else 1), **kwargs)
    assert trainer.global_step == STEPS
    _assert_bitwise(_weights(model), one_process)  # rank 0's weights came back to the caller
    # and its metrics, all three kinds, as Lightning's processes leave them in the caller's Trainer
    assert "train_loss_epoch" in trainer.callback_metrics and "train_loss_epoch" in trainer.logged_metrics
    assert trainer.lightning_module is model
    steps = sorted(open(p).read() for p in glob.glob(str(tmp_path / "rank-*.step")))
    assert steps == [str(STEPS)] * 2  # two real processes, each at the same step
    if strategy == "native_fsdp":  # each process wrote its own shards into one checkpoint
        folder = os.path.realpath(str(tmp_path / "version_0" / "checkpoints" / "last.ckpt"))
        assert sorted(os.listdir(os.path.join(folder, "state"))) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


@pytest.mark.multi_device
@pytest.mark.parametrize("first, then", [(2, 1), (1, 2)], ids=["2-then-1", "1-then-2"])
def test_fsdp_checkpoint_resumes_exactly_at_another_world_size(tmp_path, one_process, first, then, capfd):
    root = str(tmp_path)
    native_run.fit("native_fsdp", first, root, STEPS // 2, 8)  # a checkpoint of step 2 (momentum in it)
    with warnings.catch_warnings(record=True) as caught:  # a resume in this process warns here...
        warnings.simplefilter("always")
        trainer, model = native_run.fit("native_fsdp", then, root, STEPS, 8, ckpt_path="last")
    assert trainer.global_step == STEPS
    assert trainer.ckpt_path.endswith("epoch=0-step=2.ckpt")
    _assert_bitwise(_weights(model), one_process)
    # ...one in started processes on their stderr. The same global batch: the same batches, no warning
    # about them (the data module's own sampler shares them out: xtrainer cannot tell its layout, and
    # says so).
    told = [str(w.message) for w in caught] + [capfd.readouterr().err]
    assert not any("global batches are made differently" in text for text in told), told


@pytest.mark.multi_device
def test_resuming_inside_an_epoch_with_another_global_batch_warns(tmp_path, capfd):
    root = str(tmp_path)
    # a checkpoint of step 2, inside the first epoch; the strategy shares the data out (its layout is known)
    native_run.fit("native_ddp", 2, root, STEPS // 2, 8, in_order=False)
    with pytest.warns(UserWarning, match=r"Resuming inside an epoch with 1 replicas from a checkpoint of 2: the "
                                         r"global batches are made differently \(global_batch 8 -> 4\), so the rest"):
        native_run.fit("native_ddp", 1, root, STEPS, 4, ckpt_path="last", in_order=False)


@pytest.mark.multi_device
def test_sigterm_stops_both_processes_at_one_step_and_the_run_resumes_bitwise(tmp_path):
    steps, common = 24, ["--strategy", "native_ddp", "--devices", "2", "--steps", "24"]
    _reference(tmp_path, "native_ddp", 2, steps)
    process, _ = _paused_run(tmp_path, common)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=subprocess_timeout(120))
    assert process.returncode == 143, err[-3000:]
    root = tmp_path / "run"
    stopped = {open(p).read() for p in glob.glob(str(root / "rank-*.step"))}
    assert len(glob.glob(str(root / "rank-*.step"))) == 2 and len(stopped) == 1, stopped  # both, at one step
    assert 3 <= int(stopped.pop()) < steps
    _resumed_bitwise(tmp_path, common, steps)


@pytest.mark.multi_device
def test_torchrun_runs_each_replica_in_place(tmp_path, one_process):
    run = subprocess.run(_torchrun("--nproc_per_node=2", os.path.join(HERE, "native_run.py"), "--strategy",
                                   "native_fsdp", "--devices", "1", "--steps", str(STEPS), "--root", str(tmp_path),
                                   "--out", str(tmp_path / "out.pt"), "--layers", "--after-fit"),
                         env=_env(), capture_output=True, text=True, timeout=subprocess_timeout(240))
    assert run.returncode == 0, run.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    assert out["world_size"] == 2 and out["global_step"] == STEPS
    _assert_bitwise(out["weights"], one_process)
    # The module stays in each process after the fit (its Block sharded apart and wrapped for
    # activation checkpointing during it): whole plain weights under their own names, a
    # forward of its own, a later validate (sharded afresh), and save_checkpoint writes whole tensors.
    assert out["param_types"] == ["Parameter"] and out["keys"] == list(one_process)
    assert "keeps FSDP2's hooks" not in run.stderr
    reference = native_run.ExactNet()
    reference.load_state_dict(one_process)
    assert torch.equal(out["forward"], reference(torch.ones(2, native_run.FEATURES, dtype=torch.float64)).detach())
    assert out["validate"] and "val_loss" in out["validate"][0]
    from xtrainer.checkpoint import load_checkpoint

    _assert_bitwise(load_checkpoint(tmp_path / "after.ckpt")["state_dict"], one_process)
    # One run folder (rank 0's, shared): the one the other process claimed was given back.
    [folder] = glob.glob(str(tmp_path / "version_*"))
    assert out["log_dir"] == folder and os.listdir(os.path.join(folder, "checkpoints"))


def _torchrun(*args: str) -> list[str]:
    return conftest.torchrun(*args)  # on a free port, never the default 29500


def test_free_ports_are_drawn_below_the_kernels_ephemeral_range_and_bind():
    """A rendezvous port is one the kernel never hands out by itself: a port it picked (bind to
    port 0) was handed to another test's store before torchrun bound it, both "nodes" joined that
    store as clients, and its exit broke the rendezvous mid-fit (RendezvousConnectionError)."""
    import socket

    from xtrainer.strategies.launchers.processes import _ephemeral_ports_start, free_port

    ports = {free_port() for _ in range(20)}
    assert all(20000 <= port < _ephemeral_ports_start() and not 29400 <= port < 29600 for port in ports), ports
    assert len(ports) > 10  # drawn at random, not counted up from one place
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("", port))
            sock.listen()


@pytest.mark.multi_device
def test_two_torchrun_nodes_on_one_rendezvous_make_one_run(tmp_path, one_process):
    """Two torchrun commands ("nodes" on localhost, one process each) meet at a c10d rendezvous:
    one run folder, both ranks' shards in one checkpoint, the same weights as one process."""
    from xtrainer.strategies.launchers.processes import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    script = [os.path.join(HERE, "native_run.py"), "--strategy", "native_fsdp", "--steps", str(STEPS),
              "--root", str(tmp_path), "--out", str(tmp_path / "out.pt")]
    nodes = [subprocess.Popen(_torchrun("--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
                                        f"--rdzv-endpoint={endpoint}", "--rdzv-id=native-test", *script),
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    errs = [node.communicate(timeout=subprocess_timeout(240))[1] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], (errs[0][-3000:], errs[1][-3000:])
    out = torch.load(tmp_path / "out.pt")
    assert out["world_size"] == 2 and out["global_step"] == STEPS
    _assert_bitwise(out["weights"], one_process)
    [folder] = glob.glob(str(tmp_path / "version_*"))
    state = os.path.join(os.path.realpath(os.path.join(folder, "checkpoints", "last.ckpt")), "state")
    assert sorted(os.listdir(state)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


@pytest.mark.multi_device
def test_torchrun_restarts_after_a_killed_worker_and_resumes_bitwise(tmp_path):
    """A worker killed (SIGKILL) mid-fit under torchrun --max-restarts: the group restarts,
    resumes from last, and ends with the weights of an uninterrupted run."""
    steps = "16"
    _reference(tmp_path, "native_ddp", 2, int(steps))
    ready = tmp_path / "ready"
    job = subprocess.Popen(_torchrun("--nproc_per_node=2", "--max-restarts=2", "--monitor-interval=0.2",
                                     os.path.join(HERE, "native_run.py"), "--strategy", "native_ddp", "--steps", steps,
                                     "--root", str(tmp_path / "run"), "--out", str(tmp_path / "out.pt"),
                                     "--ckpt", "last", "--pause", "0.2", "--ready", str(ready)),
                           env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + subprocess_timeout(180)
    while not os.path.exists(f"{ready}-1") and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert os.path.exists(f"{ready}-1"), job.communicate()[1][-3000:]
    time.sleep(0.5)  # a step or two later: mid-epoch, after the checkpoint of step 2
    os.kill(int(open(f"{ready}-1").read()), signal.SIGKILL)
    out, err = job.communicate(timeout=subprocess_timeout(300))
    assert job.returncode == 0, err[-12000:]
    assert "resuming from" in out + err  # the restarted group resumed from a checkpoint
    a, b = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "out.pt")
    assert a["global_step"] == b["global_step"] == int(steps)
    _assert_bitwise(a["weights"], b["weights"])


@pytest.mark.multi_device
def test_sigterm_while_waiting_for_the_process_group_ends_the_process_at_once(tmp_path):
    """Rank 0 of two, its peer never started: it waits in the rendezvous. torchrun's SIGTERM ends
    it at once (nothing is trained yet), not after the launcher's 30 s grace period."""
    from xtrainer.strategies.launchers.processes import free_port

    env = dict(_env(), RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "native_run.py"), "--strategy", "native_ddp",
                             "--root", str(tmp_path), "--out", str(tmp_path / "out.pt")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(8)  # imported, blocked in the rendezvous
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=20)
    assert proc.returncode == -signal.SIGTERM and time.monotonic() - sent < 10
    assert not (tmp_path / "out.pt").exists()


def test_the_native_strategies_refuse_what_they_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="devices=2: strategy='native' runs on one device"):
        Trainer(strategy="native", devices=2)
    with pytest.raises(ValueError, match="not by a parameter count"):
        Trainer(strategy=native_run_strategy("native_fsdp", auto_wrap_policy=100))
    with pytest.raises(ValueError, match="the native strategies run on"):
        Trainer(strategy="native", accelerator="xla")
    for seconds in (-1, "0.5", True, float("nan")):
        with pytest.raises(ValueError, match=r"NativeDDP\(agreement_seconds=.*\): give seconds, 0 or more"):
            native_run_strategy("native_ddp", agreement_seconds=seconds)


class _Graph:
    """A batch class with its own ``to`` that is no collection (a graph library's batch)."""

    def __init__(self, edges: torch.Tensor) -> None:
        self.edges = edges

    def to(self, device):
        return _Graph(self.edges.to(device))


def test_the_native_loader_moves_every_tensor_and_every_object_with_a_to_method_as_lightning_does():
    """A native strategy on an accelerator moves what the loader yields (here onto torch's meta
    device, which every torch build has): tensors in containers and objects with ``to``; strings
    and numbers stay; on the CPU, or for a module with its own transfer hooks, nothing moves."""
    from xtrainer.runtimes.eager import _OnDevice

    batch = {"x": torch.ones(2), "graph": _Graph(torch.zeros(3)), "names": ["a", "b"], "n": 4}
    [moved] = list(_OnDevice([batch], torch.device("meta")))
    assert moved["x"].device.type == "meta" and moved["graph"].edges.device.type == "meta"
    assert moved["names"] == ["a", "b"] and moved["n"] == 4
    for device in (torch.device("cpu"), None):
        [kept] = list(_OnDevice([batch], device))
        assert kept is batch


@pytest.mark.parametrize("fold_after", [1024, 3], ids=["read", "folded-between-reads"])
def test_a_nan_loss_is_reported_with_its_step_without_a_host_sync_per_step(tmp_path, monkeypatch, fold_after):
    from xtrainer.loop.nonfinite import DeferredWatch

    monkeypatch.setattr(DeferredWatch, "FOLD_AFTER", fold_after)
    # Batches of 2, two per optimizer step: sample 21 is in batch 10, so in global step 5; the
    # values are read every 4 steps, so the fit learns of it at step 8.
    with pytest.raises(FloatingPointError, match=r"NaN or infinite at global step 5 .*step 8 now"):
        native_run.fit("native", 1, str(tmp_path), 12, 2, nan_at=21, accumulate_grad_batches=2,
                       log_every_n_steps=4, every_n_train_steps=100)
    with pytest.warns(UserWarning, match=r"NaN or infinite at global step 5 .*goes on") as record:
        trainer, _ = native_run.fit("native", 1, str(tmp_path / "warn"), 12, 2, nan_at=21, accumulate_grad_batches=2,
                                    log_every_n_steps=4, every_n_train_steps=100, detect_nonfinite="warn")
    assert trainer.global_step == 12  # training went on, warned once
    assert len([w for w in record if "training goes on" in str(w.message)]) == 1


@pytest.mark.parametrize("on_host", [False, True], ids=["device", "cpu"])
def test_the_deferred_watch_tells_a_nan_or_infinite_loss_from_finite_losses_whose_sum_overflows(on_host):
    """The losses kept between two reads are checked by their sum: an overflowing sum of finite
    losses is not a non-finite loss, and a NaN or an infinity is found at its own step. On the
    CPU each loss is checked as it comes, and none is kept (``device``: the device's path, run
    on CPU tensors)."""
    from xtrainer.loop.nonfinite import DeferredWatch
    from xtrainer.loop.results import to_floats

    def first_bad(losses, dtype=torch.float32):
        watch = DeferredWatch(torch.device("cpu"), 0)
        watch.on_host = on_host
        for step, loss in enumerate(losses, start=1):
            watch.observe(torch.tensor(loss, dtype=dtype), step)
        assert len(watch.losses) == (0 if on_host else len(losses))
        found = watch.first_step(to_floats(watch.local_tensors(), lambda values: values))
        assert watch.losses == [] and watch.steps == []  # read: the next interval starts afresh
        if on_host:  # what several replicas reduce: the checks' finding (a device's comes from its losses)
            assert int(watch.local_first()) == found
        return found

    huge = 3e38  # finite in float32; two of them sum to infinity
    assert first_bad([1.0, huge, huge, 2.0]) == DeferredWatch.NEVER
    assert first_bad([60000.0] * 4, dtype=torch.float16) == DeferredWatch.NEVER  # summed in float32
    assert first_bad([1.0, huge, float("inf"), float("nan")]) == 3
    assert first_bad([1.0, 2.0, float("nan")]) == 3
    assert first_bad([float("-inf"), 1.0]) == 1
    assert first_bad([1.0, 2.0]) == DeferredWatch.NEVER


def native_run_strategy(name: str, **kwargs):
    from xtrainer.strategies import STRATEGIES

    return STRATEGIES[name](**kwargs)


class _ShorterBatchLater:
    """``native_run``'s data as 8 batches of 8, except batch 3, shorter from the second epoch on."""

    def __init__(self) -> None:
        self.x, self.y = native_run.make_data().tensors
        self.epochs = 0

    def __len__(self) -> int:
        return 8

    def __iter__(self):
        epoch, self.epochs = self.epochs, self.epochs + 1  # counted as it starts: the loop reads 8, no more
        for i in range(8):
            rows = 5 if epoch >= 1 and i == 3 else 8
            yield self.x[8 * i:8 * i + rows], self.y[8 * i:8 * i + rows]


class _BreakingNet(native_run.ExactNet):
    """A forward with a graph break in it (a call torch.compile cannot trace)."""

    def forward(self, x):
        hidden = self.block(x)
        torch._dynamo.graph_break()
        return hidden.sum(dim=1, keepdim=True)


def test_health_reports_torch_compiles_compilations_graph_breaks_and_recompilations(tmp_path, capsys):
    from xtrainer.callbacks import Callback, XlaHealth
    from xtrainer.strategies import NativeSingle

    class Figures(Callback):
        def __init__(self):
            self.logged = []

        def on_metrics(self, trainer, module, metrics, step):
            self.logged.append(metrics)  # XlaHealth adds its figures to this dict, before or after this hook

    health, figures = XlaHealth(), Figures()
    trainer = Trainer(strategy=NativeSingle(compile=True, compile_kwargs={"backend": "eager"}), max_epochs=3,
                      log_every_n_steps=4, default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False,
                      enable_checkpointing=False, callbacks=[health, figures])
    with pytest.warns(UserWarning, match=r"torch.compile recompiled \d+ graph\(s\) at step 12 \(epoch 1, training "
                                         r"batch 3\), after the first epoch: this batch's shapes \(\(5, 4\), \(5, 1\)\) "
                                         r"had no graph compiled for them.*TORCH_LOGS=recompiles"):
        trainer.fit(_BreakingNet(), _ShorterBatchLater())
    assert health.totals["compilations"] >= 2 and health.totals["compile_seconds"] > 0
    assert health.totals["graph_breaks"] >= 1  # counted when a graph is traced, not on every call
    assert [r["step"] for r in health.recompilations] == [12]
    logged = [m for m in figures.logged if "torch_compile/compilations" in m]
    assert len(logged) == 6  # every 4 steps of 24
    assert logged[0]["torch_compile/compilations"] >= 1 and logged[0]["torch_compile/graph_breaks"] >= 1
    assert logged[1]["torch_compile/compilations"] == 0  # warm: nothing compiled from step 4 to 8
    assert sum(m["torch_compile/compilations"] for m in logged) == health.totals["compilations"]
    assert not any(name.startswith("xla/") or "transfers" in name for m in logged for name in m)  # not counted here
    line = next(text for text in capsys.readouterr().out.splitlines() if text.startswith("fit: 24 steps"))
    recompiled = health.recompilations[0]["graphs"]  # both graphs around the break, for the new shape
    assert "torch.compile compilations" in line and f"{recompiled} after the first epoch" in line, line
    assert "graph break(s)" in line and "transfers" not in line, line


def test_a_process_of_devices_2_that_dies_importing_the_script_ends_the_fit_with_what_happened(tmp_path):
    """A replica process that fails while importing the script (before reading its job) ends the
    caller's fit with an error: the job (weights past a pipe's 64 KiB) used to go through the
    process's start pipe, whose write then blocked for good, and no signal ended the caller."""
    script = tmp_path / "dies.py"
    script.write_text(
        "import torch\n"
        "from torch.utils.data import DataLoader\n"
        "from xtrainer import Trainer, XModule\n"
        "if __name__ == '__mp_main__':\n"
        "    raise ImportError('the replica cannot import this script')\n"
        "class M(XModule):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.layer = torch.nn.Linear(512, 512)\n"
        "    def training_step(self, batch, batch_idx):\n"
        "        return self.layer(batch).sum()\n"
        "    def configure_optimizers(self):\n"
        "        return torch.optim.SGD(self.parameters(), lr=0.1)\n"
        "if __name__ == '__main__':\n"
        "    Trainer(strategy='native_ddp', devices=2, max_steps=1, logger=False, enable_checkpointing=False,\n"
        f"            default_root_dir={str(tmp_path)!r}).fit(M(), DataLoader(torch.randn(8, 512), batch_size=2))\n")
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    run = subprocess.run([sys.executable, str(script)], env={**_env(), "TMPDIR": str(temporary)},
                         capture_output=True, text=True, timeout=subprocess_timeout(120))
    assert run.returncode != 0
    assert "the replica cannot import this script" in run.stderr
    assert "The replicas' process ended with exit code 1" in run.stderr
    assert not glob.glob(str(temporary / "xtrainer-job-*"))  # the job's file is gone
