import importlib.util
import os

# Every test runs on torch_xla's CPU runtime: real compilation, real execution (the native
# strategies' tests, tests/stories/native/test_native.py, also run where torch_xla is not installed).
os.environ.setdefault("PJRT_DEVICE", "CPU")
HAS_XLA = importlib.util.find_spec("torch_xla") is not None

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from xtrainer import XModule  # noqa: E402


def pytest_configure(config):
    """Start the XLA runtime in the test process before any CPU backward in a test: PyTorch's
    autograd engine sizes its per-device queues on its first backward and would not know the XLA
    device otherwise. In a hook, not at import: the child scripts that import this file's helpers
    (``killable_run.py`` and the others) start no runtime they do not use, and a native child
    does not pay torch_xla's import (about 7 s of CPU)."""
    if HAS_XLA:
        from xtrainer import _xla

        _xla.device()


#: How many times its time on an idle machine a child process may take before a test gives up on
#: it (``subprocess_timeout``): 3 by default, enough for a loaded two-core machine;
#: ``XTRAINER_TEST_TIMEOUT_SCALE`` sets another. A genuine hang still ends, at the scaled time.
TIMEOUT_SCALE = float(os.environ.get("XTRAINER_TEST_TIMEOUT_SCALE") or 3.0)


def subprocess_timeout(seconds: float) -> float:
    """The wait for a child process (or a file it writes) that usually takes up to ``seconds``."""
    return seconds * TIMEOUT_SCALE


def torchrun(*args: str) -> list[str]:
    """The command ``python -m torch.distributed.run *args``, on a free port: a single host's
    rendezvous (no ``--rdzv-endpoint`` given) gets ``--master-port``, never torch's default 29500,
    which another program on a busy machine may hold."""
    import sys

    from xtrainer.strategies.launchers.processes import free_port

    given = any(a.startswith(("--rdzv-endpoint", "--rdzv_endpoint", "--master-port", "--master_port")) for a in args)
    port = [] if given else [f"--master-port={free_port()}"]
    return [sys.executable, "-m", "torch.distributed.run", *port, *args]


def make_data(n: int = 64, seed: int = 0, features: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


def make_loader(n: int = 64, batch_size: int = 8, shuffle: bool = False, seed: int = 0, **kwargs) -> DataLoader:
    return DataLoader(make_data(n, seed), batch_size=batch_size, shuffle=shuffle, **kwargs)


class Regressor(XModule):
    """A small MLP regressor: every test's default module."""

    def __init__(self, lr: float = 0.05, optimizer: str = "sgd") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.lr, self.optimizer = lr, optimizer

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class RegressionData:
    """``make_loader``'s data as an object with ``*_dataloader()`` methods (for configurations)."""

    def __init__(self, n: int = 64, batch_size: int = 8, shuffle: bool = False) -> None:
        self.n, self.batch_size, self.shuffle = n, batch_size, shuffle

    def train_dataloader(self) -> DataLoader:
        return make_loader(self.n, self.batch_size, self.shuffle)

    def val_dataloader(self) -> DataLoader:
        return make_loader(16, self.batch_size, seed=1)

    test_dataloader = predict_dataloader = val_dataloader


@pytest.fixture
def trainer_kwargs(tmp_path):
    """Quiet Trainer arguments writing into the test's own folder."""
    return dict(default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False,
                enable_checkpointing=False)


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(size)``: a real filesystem of ``size`` (a tmpfs, e.g. ``"64k"``) that fills up
    for real; the test is skipped, with the reason, where one cannot be mounted (not root)."""
    import subprocess

    path = tmp_path / "small-disk"
    path.mkdir()
    mounted = []

    def mount(size: str) -> str:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"a small tmpfs cannot be mounted here (it needs root): {done.stderr.strip()}")
        mounted.append(path)
        return str(path)

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)
