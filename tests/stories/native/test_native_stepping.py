"""The optimizer's step and gradient clearing without torch's profiler ranges (``optimizer_call``
and ``clear_gradients`` in ``xtrainer/strategies/base.py``): the same weights, schedules, hooks
and warnings as ``optimizer.step()``, the range where a profiler records, and the user's own
``step`` where there is one."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from xtrainer import Trainer, XModule
from xtrainer.strategies.base import optimizer_call
from xtrainer.strategies import NativeSingle


class _Net(XModule):
    def __init__(self, optimizer=torch.optim.AdamW, scheduler: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(3, 2)
        self.optimizer, self.scheduler = optimizer, scheduler

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.layer(x).square().mean()

    def configure_optimizers(self):
        optimizer = self.optimizer(self.parameters(), lr=0.1)
        if not self.scheduler:
            return optimizer
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5), "interval": "step"}}


def _data() -> torch.Tensor:
    return torch.randn(8, 3, generator=torch.Generator().manual_seed(1))


def _fit(tmp_path, module: XModule) -> Trainer:
    trainer = Trainer(strategy=NativeSingle(), max_epochs=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(_data()), batch_size=2))
    return trainer


def test_a_fit_steps_bitwise_as_optimizer_step_with_its_scheduler_and_without_its_warning(tmp_path):
    """The steps of a fit with a per-step scheduler end bitwise where a hand loop calling
    ``optimizer.step()`` and ``scheduler.step()`` ends, at the same learning rate, and torch's
    scheduler does not warn that it stepped before the optimizer."""
    module = _Net(scheduler=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _fit(tmp_path, module)
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    hand = _Net()
    optimizer = torch.optim.AdamW(hand.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)
    for (x,) in torch.utils.data.DataLoader(torch.utils.data.TensorDataset(_data()), batch_size=2):
        optimizer.zero_grad(set_to_none=True)
        hand.layer(x).square().mean().backward()
        optimizer.step()
        scheduler.step()
    for mine, theirs in zip(module.parameters(), hand.parameters()):
        assert torch.equal(mine, theirs)
    assert trainer.optimizers[0].param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == 0.025
    assert trainer.optimizers[0].state_dict()["state"][0]["step"] == 4


class _CountingRanges(torch.autograd.profiler.record_function):
    names: list[str] = []

    def __enter__(self):
        _CountingRanges.names.append(self.name)
        return super().__enter__()


def test_without_a_profiler_no_optimizer_range_is_entered(tmp_path, monkeypatch):
    """What the fast path is for: torch's step and zero_grad ranges are not entered at all."""
    monkeypatch.setattr(torch.autograd.profiler, "record_function", _CountingRanges)
    _CountingRanges.names = []
    _fit(tmp_path, _Net())
    assert not [name for name in _CountingRanges.names if name.startswith("Optimizer.")]
    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    optimizer.step()  # the same class's own call enters it: the counter sees ranges
    assert _CountingRanges.names[-1] == "Optimizer.step#SGD.step"


def test_under_torch_profiler_the_step_range_is_recorded(tmp_path):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _fit(tmp_path, _Net(torch.optim.SGD))
    assert [event.name for event in prof.events()].count("Optimizer.step#SGD.step") == 4


def test_step_hooks_global_and_the_optimizers_own_run_around_each_step(tmp_path):
    seen = []

    class _Hooked(_Net):
        def configure_optimizers(self):
            optimizer = super().configure_optimizers()
            optimizer.register_step_post_hook(lambda opt, args, kwargs: seen.append("post"))
            return optimizer

    handle = register_optimizer_step_pre_hook(lambda opt, args, kwargs: seen.append("pre"))
    try:
        _fit(tmp_path, _Hooked())
    finally:
        handle.remove()
    assert seen == ["pre", "post"] * 4


def test_a_step_set_on_the_optimizer_instance_is_the_one_called(tmp_path):
    calls = []

    class _OwnStep(_Net):
        def configure_optimizers(self):
            optimizer = super().configure_optimizers()
            original = optimizer.step
            optimizer.step = lambda closure=None: calls.append(1) or original(closure)
            return optimizer

    module = _OwnStep()
    before = module.layer.weight.detach().clone()
    _fit(tmp_path, module)
    assert len(calls) == 4 and not torch.equal(before, module.layer.weight)


class _OwnClassStep(torch.optim.SGD):
    """An optimizer class with a ``step`` of its own: torch wraps it too; it must still run."""

    calls = 0

    def step(self, closure=None):
        _OwnClassStep.calls += 1
        return super().step(closure)


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, _OwnClassStep])
def test_the_fast_step_moves_parameters_as_optimizer_step_does(optimizer):
    """``optimizer_call`` against ``optimizer.step()`` on two copies of the same parameters."""
    _OwnClassStep.calls = 0
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    opt_a, opt_b = optimizer(a.parameters(), lr=0.1), optimizer(b.parameters(), lr=0.1)
    for _ in range(3):
        for net in (a, b):
            net.zero_grad(set_to_none=True)
            net(torch.ones(4, 3)).square().sum().backward()
        optimizer_call(opt_a)
        opt_b.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    state_a, state_b = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for index in state_a:
        assert state_a[index].keys() == state_b[index].keys()
        assert all(torch.equal(state_a[index][key], state_b[index][key]) for key in state_a[index])
    if optimizer is _OwnClassStep:
        assert _OwnClassStep.calls == 6
