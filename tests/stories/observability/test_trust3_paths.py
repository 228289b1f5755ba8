"""Paths, run folders and the suite's own robustness: a relative ``default_root_dir`` under
``torch.compile``, ``file://`` roots, one run folder and one summary under torchrun, goodput's
startup after an ``exec``, and torchrun tests that never need the default port."""

from __future__ import annotations

import contextlib
import glob
import os
import socket
import subprocess
import sys
import textwrap

import conftest
import pytest
import torch

from conftest import Regressor, make_loader, subprocess_timeout, torchrun
from xtrainer import Trainer

HERE = os.path.dirname(os.path.abspath(conftest.__file__))
REPO = os.path.dirname(HERE)


def _env(**extra: str) -> dict[str, str]:
    """The environment of a child process: this checkout importable, no cache folder inherited."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHINDUCTOR_CACHE_DIR", "XTRAINER_INDUCTOR_CACHE", "XLA_PERSISTENT_CACHE_PATH",
                        "XTRAINER_COMPILATION_CACHE")}
    env["PYTHONPATH"] = os.pathsep.join([REPO, HERE, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**env, **extra}


_COMPILED_FIT = textwrap.dedent("""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from xtrainer import Trainer, XModule
    from xtrainer.strategies import NativeSingle

    class Net(XModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Linear(4, 1)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    trainer = Trainer(strategy=NativeSingle(compile=True), max_steps=2, default_root_dir="runs",
                      enable_progress_bar=False, logger=False)
    trainer.fit(Net(), DataLoader(data, batch_size=8))
    print("LOG_DIR", trainer.log_dir)
""")


@pytest.fixture(scope="module")
def compiled_run(tmp_path_factory):
    """``_COMPILED_FIT`` run once in a folder of its own: (the folder, the finished process)."""
    work = tmp_path_factory.mktemp("compiled") / "work"
    work.mkdir()
    (work / "fit.py").write_text(_COMPILED_FIT)
    done = subprocess.run([sys.executable, "fit.py"], cwd=work, env=_env(), capture_output=True, text=True,
                          timeout=subprocess_timeout(600))
    return work, done


def test_torch_compile_with_a_relative_default_root_dir_compiles_and_caches_under_it(compiled_run):
    """``default_root_dir="runs"`` (as examples/digits.yaml writes it) with ``compile=True``: the
    first forward compiles (Inductor compiles from a folder of its own, where a relative cache
    folder failed: ``g++ runs/inductor_cache/...cpp: No such file or directory``), and the cache
    lies under the run's own ``runs/``, named by its absolute path."""
    work, done = compiled_run
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LOG_DIR runs/version_0" in done.stdout
    cache = work / "runs" / "inductor_cache" / "rank_0"
    assert cache.is_dir() and any(cache.iterdir())
    assert f"compilation cache {cache}:" in done.stdout + done.stderr


def test_compiled_kernels_a_killed_compiler_left_incomplete_are_built_again(compiled_run):
    """A process killed while the C++ compiler wrote its kernels leaves them cut short in the
    cache beside the run (the compiler writes in place; Inductor takes any file that exists for a
    finished build, and the next run failed, here with g++ errors while it built a kernel beside the
    cut files). The next run removes them, builds them again and trains."""
    work, done = compiled_run
    assert done.returncode == 0, done.stderr[-3000:]
    cache = work / "runs" / "inductor_cache" / "rank_0"
    built = [p for p in cache.rglob("*") if p.suffix in (".so", ".o") and p.is_file()]
    assert built, sorted(str(p) for p in cache.rglob("*"))
    for path in built:  # as a kill in the middle of the compiler's write leaves them
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
    again = subprocess.run([sys.executable, "fit.py"], cwd=work, env=_env(), capture_output=True, text=True,
                           timeout=subprocess_timeout(600))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{len(built)} incomplete compiled files (a process killed while compiling) removed" in \
        again.stdout + again.stderr
    assert all(p.stat().st_size > 64 for p in built if p.exists())


def test_the_compilation_cache_folders_are_absolute_when_set(tmp_path, monkeypatch):
    """Every cache folder is absolute, against the working directory when the run starts: the
    default under a relative runs root, a relative folder given, a file:// URL, and a folder the
    environment names."""
    from xtrainer import compile_cache

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("XLA_PERSISTENT_CACHE_PATH", raising=False)
    assert compile_cache.folder_for(True, "runs") == str(tmp_path / "runs" / "xla_cache")
    assert compile_cache.folder_for(True, f"file://{tmp_path}/r") == str(tmp_path / "r" / "xla_cache")
    assert compile_cache.folder_for("cache", "runs") == str(tmp_path / "cache")
    assert compile_cache.folder_for(f"file://{tmp_path}/c", "runs") == str(tmp_path / "c")
    assert compile_cache.folder_for(True, "s3://bucket/runs") is None  # no cache on an object store
    monkeypatch.setenv("XLA_PERSISTENT_CACHE_PATH", "mine")
    assert compile_cache.folder_for(None, "runs") == str(tmp_path / "mine")


def test_a_file_url_root_writes_and_resumes_where_a_local_path_would(tmp_path):
    """``default_root_dir="file://<tmp>"``: the run folder, its checkpoints and ``last`` are where
    ``default_root_dir="<tmp>"`` puts them (it failed at once: "Cannot create the run folder"),
    and ``ckpt_path="last"`` (and a ``file://`` checkpoint path) resume from them."""
    root = tmp_path / "runs"
    kwargs = dict(strategy="native", default_root_dir=f"file://{root}", enable_progress_bar=False, logger=False)
    first = Trainer(max_steps=4, **kwargs)
    first.fit(Regressor(), make_loader())
    assert first.log_dir == str(root / "version_0")
    assert sorted(os.listdir(root / "version_0" / "checkpoints")) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    resumed = Trainer(max_steps=8, **kwargs)
    resumed.fit(Regressor(), make_loader(), ckpt_path="last")
    assert resumed.ckpt_path == os.path.realpath(root / "version_0" / "checkpoints" / "epoch=0-step=4.ckpt")
    assert resumed.global_step == 8 and resumed.log_dir == str(root / "version_1")
    assert os.path.isfile(root / "version_1" / "checkpoints" / "epoch=0-step=8.ckpt")
    named = Trainer(max_steps=10, **kwargs)
    named.fit(Regressor(), make_loader(), ckpt_path=f"file://{root}/version_1/checkpoints/last.ckpt")
    assert named.global_step == 10 and named.log_dir == str(root / "version_2")
    assert sorted(os.listdir(root)) == ["version_0", "version_1", "version_2"]


def test_file_urls_are_local_paths():
    from xtrainer.checkpoint import fs

    assert fs.local("file:///data/runs") == "/data/runs"
    assert fs.local("FILE://localhost/data/runs") == "/data/runs"
    assert fs.local("file://runs") == "runs"
    assert fs.local("s3://bucket/runs") == "s3://bucket/runs" and fs.local("/data") == "/data"


_TORCHRUN_CONFIG = """
seed: 3
model:
  _target_: conftest.Regressor
data:
  _target_: conftest.RegressionData
  batch_size: 8
trainer:
  strategy: native_ddp
  max_epochs: 2
  enable_progress_bar: false
  logger: false
  callbacks:
    - _target_: kill_once.KillRankOneOnce
"""

_KILL_ONCE = textwrap.dedent("""
    import os
    import signal

    from xtrainer.callbacks import Callback

    class KillRankOneOnce(Callback):
        \"\"\"Rank 1 of torchrun's first attempt dies (SIGKILL) in the second epoch, after the first
        epoch's checkpoint, when KILL_ONCE is set.\"\"\"

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if (os.environ.get("KILL_ONCE") and os.environ.get("RANK") == "1" and trainer.current_epoch == 1
                    and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
                os.kill(os.getpid(), signal.SIGKILL)
""")


@contextlib.contextmanager
def _holding_port(port: int):
    """Hold ``port`` (listening, as another program's server would) while inside; where it is
    already held, it stays held by its owner."""
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
            sock.listen()
        except OSError:
            pass  # held already: all the better for the test
        yield


@pytest.mark.multi_device
@pytest.mark.parametrize("restart", [False, True], ids=["one-attempt", "a-worker-killed-and-restarted"])
def test_xtrainer_fit_under_torchrun_makes_one_run_folder_and_one_summary(tmp_path, restart):
    """``torchrun --nproc-per-node 2 -m xtrainer fit``: only rank 0 claims a run folder (with its
    config.yaml) and prints the values at the end; the other rank learns rank 0's folder and
    leaves none of its own (it left a ``version_N`` with a ``config.yaml`` per rank and restart).
    With a worker killed and the group restarted (``--max-restarts``), each attempt is one run:
    one folder each, and one summary from the attempt that finished. Torch's default port 29500
    is held meanwhile: the launch must not need it."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "kill_once.py").write_text(_KILL_ONCE)
    (work / "run.yaml").write_text(_TORCHRUN_CONFIG + f"  default_root_dir: {tmp_path / 'runs'}\n")
    restarts = ["--max-restarts=1", "--monitor-interval=0.2"] if restart else []
    env = _env(**({"KILL_ONCE": "1"} if restart else {}))
    env["PYTHONPATH"] = os.pathsep.join([str(work), env["PYTHONPATH"]])
    with _holding_port(29500):
        done = subprocess.run(torchrun("--nproc-per-node=2", *restarts, "-m", "xtrainer", "fit", "--config",
                                       str(work / "run.yaml"), *(["ckpt_path=last"] if restart else [])),
                              cwd=work, env=env, capture_output=True, text=True, timeout=subprocess_timeout(300))
    assert done.returncode == 0, done.stderr[-5000:]
    folders = sorted(os.listdir(tmp_path / "runs"))
    attempts = 2 if restart else 1
    assert [f for f in folders if f.startswith("version_")] == [f"version_{i}" for i in range(attempts)], folders
    for folder in range(attempts):
        assert os.path.isfile(tmp_path / "runs" / f"version_{folder}" / "config.yaml")
    assert done.stdout.count("run folder") == attempts, done.stdout
    assert done.stdout.count("  train_loss_epoch:") == 1, done.stdout  # the end-of-fit summary, once
    if restart:
        assert "resuming from" in done.stdout  # the second attempt continued from the first's checkpoint


_GOODPUT_FIT = textwrap.dedent("""
    import time
    python_ran_at = time.time()  # this script's first line
    import json
    from conftest import Regressor, make_loader
    from xtrainer import Trainer
    from xtrainer.goodput import Goodput

    goodput = Goodput(summary=False)
    trainer = Trainer(strategy="native", max_steps=2, default_root_dir="runs", enable_progress_bar=False,
                      logger=False, enable_checkpointing=False, callbacks=[goodput])
    trainer.fit(Regressor(), make_loader())
    print(json.dumps({"python_ran_at": python_ran_at, "started_at": goodput.record["process_started_at"],
                      "startup": goodput.record["seconds"]["startup"]}))
""")


def _dev_function(name: str) -> str:
    """The shell function ``name`` as ``./dev`` defines it."""
    lines = open(os.path.join(REPO, "dev")).read().splitlines()
    start = lines.index(f"{name}() {{")
    return "\n".join(lines[start:lines.index("}", start) + 1])


@pytest.mark.parametrize("stamped", [True, False], ids=["through-dev's-exec", "a-bare-exec"])
def test_goodput_startup_counts_from_pythons_start_after_a_shell_execs_it(tmp_path, stamped):
    """A shell that works for 3 s (``./dev``'s first install took 123 s) and then ``exec``s Python:
    the pid, and its start time, are the shell's. Through ``./dev``'s own ``run_python`` the
    startup counts from the exec, after the 3 s; a bare exec says nothing of when it happened,
    and its startup still holds the shell's 3 s (what the ``./dev example`` line was wrong about)."""
    import json

    (tmp_path / "fit.py").write_text(_GOODPUT_FIT)
    run = "run_python" if stamped else "exec"
    script = (f"{_dev_function('run_python')}\ndate +%s.%N > shell_started\nsleep 3\n"
              f"{run} {sys.executable} fit.py\n")
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=_env(PJRT_DEVICE="CPU"), capture_output=True,
                          text=True, timeout=subprocess_timeout(240))
    assert done.returncode == 0, done.stderr[-3000:]
    shell_started = float((tmp_path / "shell_started").read_text())
    got = json.loads(done.stdout.strip().splitlines()[-1])
    python_took = got["startup"] - (got["python_ran_at"] - got["started_at"])  # from the script's first line
    if stamped:  # from the exec: after the shell's 3 s, before the script's first line
        assert shell_started + 3 <= got["started_at"] <= got["python_ran_at"], got
        assert got["python_ran_at"] - got["started_at"] < 3, got  # the interpreter's own start only
    else:  # the shell's start (whole seconds of boot time in /proc: within a second)
        assert got["started_at"] < shell_started + 1.5 and got["startup"] >= 2.5 + python_took, got


def test_a_started_at_inherited_from_another_process_is_not_taken(tmp_path):
    """``XTRAINER_STARTED_AT`` is taken out of the environment once read, and one set before this
    process started (inherited from a parent that never read it) is ignored."""
    import time

    code = "import os, xtrainer.goodput as g; print(g.process_started_at(), g.STARTED_AT_VARIABLE in os.environ)"
    stale = time.time() - 30  # set long before the child starts
    done = subprocess.run([sys.executable, "-c", code], env=_env(XTRAINER_STARTED_AT=str(stale)),
                          capture_output=True, text=True, timeout=subprocess_timeout(120))
    assert done.returncode == 0, done.stderr[-3000:]
    started_at, still_set = done.stdout.split()
    assert float(started_at) > stale + 25 and still_set == "False", done.stdout  # the child's own start
