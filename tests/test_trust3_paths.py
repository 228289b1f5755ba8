"""Paths, run folders and the suite's own robustness: a relative ``default_root_dir`` under
``torch.compile``, ``file://`` roots, one run folder and one summary under torchrun, goodput's
startup after an ``exec``, and torchrun tests that never need the default port."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import Regressor, make_loader, subprocess_timeout
from xtrainer import Trainer

HERE = os.path.dirname(os.path.abspath(__file__))
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


def test_torch_compile_with_a_relative_default_root_dir_compiles_and_caches_under_it(tmp_path):
    """``default_root_dir="runs"`` (as examples/digits.yaml writes it) with ``compile=True``: the
    first forward compiles (Inductor compiles from a folder of its own, where a relative cache
    folder failed: ``g++ runs/inductor_cache/...cpp: No such file or directory``), and the cache
    lies under the run's own ``runs/``, named by its absolute path."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "fit.py").write_text(_COMPILED_FIT)
    done = subprocess.run([sys.executable, "fit.py"], cwd=work, env=_env(), capture_output=True, text=True,
                          timeout=subprocess_timeout(600))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LOG_DIR runs/version_0" in done.stdout
    cache = work / "runs" / "inductor_cache" / "rank_0"
    assert cache.is_dir() and any(cache.iterdir())
    assert f"compilation cache {cache}:" in done.stdout + done.stderr


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
