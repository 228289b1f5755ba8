"""Rank 0 of ``devices=N`` under the native strategies runs in the calling process, as Lightning's
``ddp`` runs it: the caller's module is the trained one, with whatever the hooks added to it, and
the other ranks are started processes. A second fit in the same process starts afresh and leaves
the environment as it was; a rank that fails is named, one that never joins ends the wait with a
clear error. Where replicas must stay copies (the XLA strategies with several devices), what a
hook added to them is named in a clear error.

The module and data are ``native_run.py``'s (float64, dyadic: every sum of a step is exact), so
that two processes compare bitwise with one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import native_run
from test_native import _assert_bitwise, _env, _weights
from xtrainer.callbacks import Callback

STEPS = 4
pytestmark = pytest.mark.multi_device


class OnlineFinetuner(Callback):
    """As self-supervised projects' online evaluators do: a head added to the module in
    ``on_fit_start``, trained after each batch on the module's detached outputs with an optimizer
    of its own. Its gradients are averaged over the replicas (``all_gather``), so that it trains
    as one process does on the global batch; weights and learning rate are dyadic (exact sums)."""

    def on_fit_start(self, trainer, pl_module):
        pl_module.online_finetuner = nn.Linear(1, 1).double()
        with torch.no_grad():
            pl_module.online_finetuner.weight.fill_(1 / 4)
            pl_module.online_finetuner.bias.fill_(-1 / 8)
        self.optimizer = torch.optim.SGD(pl_module.online_finetuner.parameters(), lr=1 / 16)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        x, y = batch
        with torch.no_grad():
            features = pl_module(x)
        loss = ((pl_module.online_finetuner(features) - y) ** 2).mean()
        loss.backward()
        if trainer.world_size > 1:  # (one process's all_gather gives the tensor as it is, as Lightning's)
            for param in pl_module.online_finetuner.parameters():
                param.grad = pl_module.all_gather(param.grad).mean(dim=0)
        self.optimizer.step()
        self.optimizer.zero_grad()


class WhereRankZeroRuns(Callback):
    """Rank 0's process id and the process group's world size, seen mid-fit."""

    def on_train_start(self, trainer, pl_module):
        if trainer.is_global_zero:
            self.pid, self.world_size = os.getpid(), torch.distributed.get_world_size()


class FailOnRank(Callback):
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2 and trainer.global_rank == self.rank:
            raise ValueError(f"a hook failed on rank {self.rank}")


class AddsAHead(Callback):
    def on_fit_start(self, trainer, pl_module):
        pl_module.online_finetuner = nn.Linear(1, 1)


_GROUP_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                    "MASTER_PORT", "XTRAINER_NATIVE_REPLICA")


def test_a_submodule_a_callback_adds_in_on_fit_start_is_trained_in_the_callers_module(tmp_path):
    _, alone = native_run.fit("native", 1, str(tmp_path / "one"), STEPS, 8, callbacks=[OnlineFinetuner()])
    where = WhereRankZeroRuns()
    trainer, model = native_run.fit("native_ddp", 2, str(tmp_path / "two"), STEPS, 8,
                                    callbacks=[OnlineFinetuner(), where])
    assert trainer.global_step == STEPS and where.world_size == 2
    assert where.pid == os.getpid()  # rank 0 ran here, on this very module
    assert isinstance(model.online_finetuner, nn.Linear)
    trained = model.online_finetuner.state_dict()
    assert not torch.equal(trained["weight"], torch.full((1, 1), 1 / 4, dtype=torch.float64))  # it trained
    _assert_bitwise(_weights(model), _weights(alone))  # the head and the module, as one process on the global batch
    assert not torch.distributed.is_initialized()


def test_a_second_fit_in_the_same_process_starts_afresh_and_the_environment_is_left_as_it_was(tmp_path, monkeypatch):
    for name in _GROUP_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    threads = torch.get_num_threads()
    runs = []
    for strategy in ("native_ddp", "native_fsdp"):
        where = WhereRankZeroRuns()
        trainer, model = native_run.fit(strategy, 2, str(tmp_path / strategy), STEPS, 8, callbacks=[where])
        assert trainer.global_step == STEPS and where.pid == os.getpid() and where.world_size == 2
        assert trainer.world_size == 2  # the run's, as in Lightning, though its group is gone
        assert not torch.distributed.is_initialized()  # the caller's group is gone with its stage
        # torch's variables never were in this process's environment (a later Trainer would think it
        # runs under torchrun), and its intra-op threads are its own again
        assert not [name for name in _GROUP_VARIABLES if name in os.environ] and torch.get_num_threads() == threads
        runs.append(_weights(model))
    _assert_bitwise(*runs)  # the same training, each in a group of its own (a new port each)
    # and a validate after the fit, in a group of its own again
    from torch.utils.data import DataLoader

    results = trainer.validate(model, DataLoader(native_run.make_data(16), batch_size=4))
    assert "val_loss" in results[0] and not torch.distributed.is_initialized()


def test_a_rank_that_fails_is_named_and_rank_zeros_own_error_ends_the_others(tmp_path):
    for rank in (1, 0):
        started = time.monotonic()
        with pytest.raises(ValueError, match=f"a hook failed on rank {rank}") as caught:
            native_run.fit("native_ddp", 2, str(tmp_path / str(rank)), 8, 8, callbacks=[FailOnRank(rank)])
        assert f"(raised in replica {rank} of 2" in "".join(caught.value.__notes__)
        assert time.monotonic() - started < 60  # the other rank, waiting for it in a collective, was ended
        assert not torch.distributed.is_initialized()


def test_a_rank_that_never_joins_ends_the_wait_with_a_clear_error(tmp_path):
    script = tmp_path / "never.py"
    script.write_text(
        "import time\n"
        "from torch.utils.data import DataLoader\n"
        "import native_run\n"
        "from xtrainer import Trainer\n"
        "from xtrainer.strategies import NativeDDP\n"
        "if __name__ == '__mp_main__':\n"
        "    time.sleep(600)  # a started rank stuck while it imports the script\n"
        "if __name__ == '__main__':\n"
        "    Trainer(strategy=NativeDDP(timeout_seconds=5), devices=2, accelerator='cpu', max_steps=2, logger=False,\n"
        f"            default_root_dir={str(tmp_path)!r}, enable_progress_bar=False).fit(\n"
        "        native_run.ExactNet(), DataLoader(native_run.make_data(16), batch_size=4))\n")
    started = time.monotonic()
    run = subprocess.run([sys.executable, str(script)], env=_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "RuntimeError: Trainer(devices=2): 1 of the 1 started processes did not join the process group within " \
           "timeout_seconds=5 s" in run.stderr, run.stderr[-3000:]
    assert time.monotonic() - started < 60


def test_what_a_hook_adds_to_the_xla_thread_replicas_copies_is_named_with_what_to_do(tmp_path):
    pytest.importorskip("torch_xla")
    from conftest import Regressor, make_loader
    from xtrainer import Trainer

    model = Regressor()
    start = _weights(model)
    trainer = Trainer(strategy="xla_ddp", devices=2, max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                      callbacks=[AddsAHead()])
    with pytest.raises(RuntimeError, match=r"strategy='xla_ddp' trained copies of Regressor in its replicas, and "
                                           r"their parameters or buffers changed during fit: online_finetuner.weight "
                                           r"\(added\), online_finetuner.bias \(added\); .* Create every submodule, "
                                           r"parameter and buffer in the module's __init__ .* or use a native strategy"):
        trainer.fit(model, make_loader(batch_size=4))
    _assert_bitwise(_weights(model), start)
