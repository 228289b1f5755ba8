"""Fitting: loop semantics, hooks, steps, accumulation, clipping, precision."""

import copy
import math
import warnings

import pytest
import torch
from conftest import Regressor, make_data, make_loader
from torch import nn
from torch.utils.data import DataLoader

from xtrainer import Trainer
from xtrainer.callbacks import Callback


def reference_sgd(model: nn.Module, loader, epochs: int, lr: float, accumulate: int = 1) -> nn.Module:
    """Plain PyTorch on the CPU: what the Trainer must compute."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(epochs):
        batches = list(loader)
        for i, (x, y) in enumerate(batches):
            loss = nn.functional.mse_loss(model(x), y) / accumulate
            loss.backward()
            if (i + 1) % accumulate == 0 or i + 1 == len(batches):
                opt.step()
                opt.zero_grad()
    return model


def assert_same_params(a: nn.Module, b: nn.Module, atol: float = 1e-5) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p.detach().cpu(), q.detach().cpu(), atol=atol), name


def test_fit_matches_plain_pytorch_and_leaves_weights_on_cpu(trainer_kwargs):
    model = Regressor()
    expected = reference_sgd(model, make_loader(), epochs=2, lr=0.05)
    trainer = Trainer(max_epochs=2, **trainer_kwargs)
    trainer.fit(model, make_loader())
    assert trainer.global_step == 16 and trainer.current_epoch == 2
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert_same_params(model, expected)
    # as Lightning: "train_loss" (logged per step and per epoch) is also there, the epoch's value
    assert set(trainer.callback_metrics) == {"train_loss", "train_loss_step", "train_loss_epoch"}
    assert trainer.callback_metrics["train_loss"] == trainer.callback_metrics["train_loss_epoch"]
    # 0-dim tensors on the CPU, as Lightning gives them (.item() works)
    assert all(isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.dim() == 0
               for v in trainer.callback_metrics.values())


def test_gradient_accumulation_matches_large_batches(trainer_kwargs):
    model = Regressor()
    expected = reference_sgd(model, make_loader(n=56), epochs=1, lr=0.05, accumulate=3)
    trainer = Trainer(max_epochs=1, accumulate_grad_batches=3, **trainer_kwargs)
    trainer.fit(model, make_loader(n=56))  # 7 batches: steps after 3, 6 and the last one
    assert trainer.global_step == 3
    assert_same_params(model, expected)


class Recorder(Callback):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattribute__(self, name):
        attr = object.__getattribute__(self, name)
        if name.startswith("on_") and callable(attr):
            calls = object.__getattribute__(self, "calls")

            def record(*args, **kwargs):
                calls.append(name)
                return attr(*args, **kwargs)

            return record
        return attr


class RecordingModule(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.module_calls: list[str] = []

    def on_train_epoch_end(self):
        self.module_calls.append("on_train_epoch_end")

    def on_before_optimizer_step(self, optimizer):
        self.module_calls.append("on_before_optimizer_step")


def test_hook_order_and_counts(trainer_kwargs):
    rec = Recorder()
    model = RecordingModule()
    trainer = Trainer(max_epochs=2, limit_train_batches=3, limit_val_batches=2, accumulate_grad_batches=1,
                      callbacks=[rec], **trainer_kwargs)
    trainer.fit(model, make_loader(), make_loader(n=32))
    calls = rec.calls
    count = {name: calls.count(name) for name in set(calls)}
    assert count == {
        "on_fit_start": 1, "on_train_start": 1, "on_train_epoch_start": 2, "on_train_epoch_end": 2,
        "on_train_batch_start": 6, "on_train_batch_end": 6, "on_before_backward": 6, "on_after_backward": 6,
        "on_before_optimizer_step": 6, "on_before_zero_grad": 6,
        # the sanity check (num_sanity_val_steps=2, Lightning's default) is one more validation
        "on_sanity_check_start": 1, "on_sanity_check_end": 1,
        "on_validation_start": 3, "on_validation_epoch_start": 3, "on_validation_batch_start": 6,
        "on_validation_batch_end": 6, "on_validation_epoch_end": 3, "on_validation_end": 3,
        "on_train_end": 1, "on_fit_end": 1,
        "on_metrics": 4,  # each epoch's end and each validation's: the only reads (log_every_n_steps=50)
    }
    first_batch = calls[calls.index("on_train_batch_start"):calls.index("on_train_batch_end") + 1]
    # Lightning's order: zero_grad after training_step, before backward
    assert first_batch == ["on_train_batch_start", "on_before_zero_grad", "on_before_backward", "on_after_backward",
                           "on_before_optimizer_step", "on_train_batch_end"]
    # validation at the end of an epoch runs before on_train_epoch_end
    assert calls.index("on_validation_end") < calls.index("on_train_epoch_end")
    assert calls[:5] == ["on_fit_start", "on_sanity_check_start", "on_validation_start",
                         "on_validation_epoch_start", "on_validation_batch_start"]
    after_sanity = calls[calls.index("on_sanity_check_end"):][:3]
    assert after_sanity == ["on_sanity_check_end", "on_train_start", "on_train_epoch_start"]
    assert calls[-2:] == ["on_train_end", "on_fit_end"]
    assert model.module_calls.count("on_train_epoch_end") == 2
    assert model.module_calls.count("on_before_optimizer_step") == 6


def test_gradients_are_cleared_where_lightning_clears_them(trainer_kwargs):
    """zero_grad runs after training_step and before backward, on the first micro-batch of each
    accumulation window (Lightning's place): a step's gradients are still there in
    on_train_batch_end, each window starts from none, and the fit drops the last ones at its end
    (Lightning keeps them; here they would be moved to the host with the weights)."""
    seen = []

    class Watch(Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.batch = batch_idx

        def on_before_zero_grad(self, trainer, module, optimizer):
            seen.append(("zero_grad", self.batch))

        def on_before_backward(self, trainer, module, loss):
            grads = [p.grad for p in module.parameters()]
            seen.append(("backward", self.batch, "none" if all(g is None for g in grads) else "kept"))

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            grads = [p.grad for p in module.parameters()]
            seen.append(("end", batch_idx, all(g is not None and bool(g.abs().sum() > 0) for g in grads)))

    model = Regressor(lr=0.05)
    trainer = Trainer(max_epochs=1, accumulate_grad_batches=3, callbacks=[Watch()], **trainer_kwargs)
    trainer.fit(model, make_loader(n=56))  # 7 batches of 8: windows 0-2, 3-5, 6
    assert seen == [
        ("zero_grad", 0), ("backward", 0, "none"), ("end", 0, True),
        ("backward", 1, "kept"), ("end", 1, True), ("backward", 2, "kept"), ("end", 2, True),
        ("zero_grad", 3), ("backward", 3, "none"), ("end", 3, True),
        ("backward", 4, "kept"), ("end", 4, True), ("backward", 5, "kept"), ("end", 5, True),
        ("zero_grad", 6), ("backward", 6, "none"), ("end", 6, True),
    ]
    assert all(p.grad is None for p in model.parameters())  # dropped after on_fit_end


class SkipsOddBatches(Regressor):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx % 2 else loss


@pytest.mark.parametrize("strategy", ["xla_native", "xla_ddp", "native", "native_ddp"])
def test_training_step_returning_none_skips_the_batch_as_in_lightning(trainer_kwargs, strategy):
    """Lightning's skip: no backward (nor its hooks) for that batch; zero_grad and the optimizer
    step still run and the step is counted; on_train_batch_end receives {}. With plain SGD a step
    over no gradients leaves the weights: they end as trained on the other batches alone."""
    seen = []

    class Watch(Callback):
        def on_before_backward(self, trainer, module, loss):
            seen.append("backward")

        def on_before_optimizer_step(self, trainer, module, optimizer):
            seen.append("step")

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen.append(outputs if batch_idx % 2 else "end")

    loader = make_loader()  # 8 batches
    expected = reference_sgd(Regressor(), [b for i, b in enumerate(loader) if i % 2 == 0], epochs=1, lr=0.05)
    model = SkipsOddBatches()
    trainer = Trainer(max_epochs=1, strategy=strategy, callbacks=[Watch()], **trainer_kwargs)
    with pytest.warns(UserWarning, match="training_step returned None: the batch is skipped"):
        trainer.fit(model, loader)
    assert trainer.global_step == 8
    assert seen == ["backward", "step", "end", "step", {}] * 4
    assert_same_params(model, expected)


def test_training_step_returning_none_with_several_replicas_says_what_to_do(trainer_kwargs):
    """Several replicas cannot skip alone: the others would wait in backward's all-reduce."""
    trainer = Trainer(max_epochs=1, strategy="xla_native", devices=2, **trainer_kwargs)
    with pytest.raises(ValueError, match=r"training_step returned None at batch 1 to skip it, but 2 replicas train "
                                         r"together.*`loss \* 0`"):
        trainer.fit(SkipsOddBatches(), make_loader())


def test_max_steps_stops_mid_epoch(trainer_kwargs):
    trainer = Trainer(max_steps=5, max_epochs=10, **trainer_kwargs)
    trainer.fit(Regressor(), make_loader())
    assert trainer.global_step == 5 and trainer.current_epoch == 0


@pytest.mark.parametrize("limit, batches", [(3, 3), (0.5, 4), (1.0, 8), (100, 8)])
def test_limit_train_batches(trainer_kwargs, limit, batches):
    trainer = Trainer(max_epochs=2, limit_train_batches=limit, **trainer_kwargs)
    trainer.fit(Regressor(), make_loader())
    assert trainer.global_step == 2 * batches


def test_val_check_interval_and_every_n_epochs(trainer_kwargs):
    rec = Recorder()
    trainer = Trainer(max_epochs=4, val_check_interval=4, check_val_every_n_epoch=2, callbacks=[rec], num_sanity_val_steps=0,
                      **trainer_kwargs)
    trainer.fit(Regressor(), make_loader(), make_loader(n=16))
    assert rec.calls.count("on_validation_start") == 4  # twice in each of epochs 1 and 3


def test_val_check_interval_counts_batches_across_epochs_without_check_val_every_n_epoch(trainer_kwargs):
    """Lightning's recipe for validating every N batches whatever the epochs' length:
    ``check_val_every_n_epoch=None``. With it set, an interval no epoch reaches is refused."""
    steps = []

    class At(Callback):
        def on_validation_start(self, trainer, module):
            steps.append(trainer.global_step)

    trainer = Trainer(max_epochs=3, val_check_interval=3, check_val_every_n_epoch=None, callbacks=[At()],
                      num_sanity_val_steps=0, **trainer_kwargs)
    trainer.fit(Regressor(), make_loader(), make_loader(n=16))  # 8 batches an epoch
    assert steps == [3, 6, 9, 12, 15, 18, 21, 24]
    with pytest.raises(ValueError, match="val_check_interval=10 is more than the 8 training batches"):
        Trainer(max_epochs=3, val_check_interval=10, **trainer_kwargs).fit(Regressor(), make_loader(),
                                                                             make_loader(n=16))


def test_should_stop_from_a_callback(trainer_kwargs):
    class StopAfter3(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 3:
                trainer.should_stop = True

    trainer = Trainer(max_epochs=5, callbacks=[StopAfter3()], **trainer_kwargs)
    trainer.fit(Regressor(), make_loader())
    assert trainer.global_step == 3


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_gradient_clipping(trainer_kwargs, algorithm):
    model = Regressor(lr=1.0)
    x, y = next(iter(make_loader()))
    ref = copy.deepcopy(model)
    nn.functional.mse_loss(ref(x), y).backward()
    grads = [p.grad.clone() for p in ref.parameters()]
    if algorithm == "norm":
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
        expected_grads = [g * min(1.0, 0.01 / (norm.item() + 1e-6)) for g in grads]
    else:
        expected_grads = [g.clamp(-0.001, 0.001) for g in grads]
    clip = 0.01 if algorithm == "norm" else 0.001
    trainer = Trainer(max_steps=1, gradient_clip_val=clip, gradient_clip_algorithm=algorithm, **trainer_kwargs)
    before = [p.detach().clone() for p in model.parameters()]
    trainer.fit(model, make_loader())
    for b, p, g in zip(before, model.parameters(), expected_grads):
        assert torch.allclose(b - p.detach(), g, atol=1e-5)


def test_lr_scheduler_by_step_and_epoch(trainer_kwargs):
    class Scheduled(Regressor):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1.0)
            by_step = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": by_step, "interval": "step", "frequency": 2}}

    trainer = Trainer(max_steps=8, **trainer_kwargs)
    model = Scheduled()
    trainer.fit(model, make_loader())
    # stepped after steps 2, 4, 6 and 8: lr = 0.5 ** 4
    assert math.isclose(trainer.optimizers[0].param_groups[0]["lr"], 0.5 ** 4)
    assert trainer.lr_schedulers[0].last_epoch == 4
    # Lightning counts the frequency in batches of the epoch, not in global steps: 5 batches an
    # epoch step it after batches 2 and 4 of each (4 times in 2 epochs, not after global step 6)
    trainer = Trainer(max_epochs=2, **trainer_kwargs)
    trainer.fit(Scheduled(), make_loader(n=40))
    assert trainer.global_step == 10 and trainer.lr_schedulers[0].last_epoch == 4


def test_bf16_precision_trains_in_bfloat16(trainer_kwargs):
    dtypes = []

    class Probe(Regressor):
        def training_step(self, batch, batch_idx):
            dtypes.append((batch[0].dtype, self.net[0].weight.dtype))
            return super().training_step(batch, batch_idx)

    model = Probe(lr=0.1)
    trainer = Trainer(max_epochs=3, precision="bf16", log_every_n_steps=1, **trainer_kwargs)
    first = []

    class First(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 1:
                first.append(trainer.callback_metrics["train_loss_step"])
                # as Lightning: between epoch ends the plain name is the latest step's value
                assert trainer.callback_metrics["train_loss"] == first[0]

    trainer.callbacks.append(First())
    trainer.fit(model, make_loader())
    assert set(dtypes) == {(torch.bfloat16, torch.bfloat16)}
    assert model.net[0].weight.dtype == torch.bfloat16
    assert trainer.callback_metrics["train_loss_step"] < first[0]


def test_logged_epoch_mean_is_weighted_by_batch_size(trainer_kwargs):
    class LogX(Regressor):
        def training_step(self, batch, batch_idx):
            x, _ = batch
            self.log("x0", x[:, 0].mean(), on_step=False, on_epoch=True)
            self.log("x0_max", x[:, 0].max(), on_step=False, on_epoch=True, reduce_fx="max")
            self.log("rows", torch.tensor(float(x.shape[0])), on_step=False, on_epoch=True, reduce_fx="sum")
            return super().training_step(batch, batch_idx)

    loader = make_loader(n=20, batch_size=8)  # batches of 8, 8, 4
    trainer = Trainer(max_epochs=1, **trainer_kwargs)
    trainer.fit(LogX(), loader)
    x = loader.dataset.tensors[0]
    assert math.isclose(trainer.callback_metrics["x0"], x[:, 0].mean().item(), rel_tol=1e-5)
    assert math.isclose(trainer.callback_metrics["x0_max"], x[:, 0].max().item(), rel_tol=1e-6)
    assert trainer.callback_metrics["rows"] == 20.0


class TextsAndFeatures(torch.utils.data.Dataset):
    """Samples of (text, features): batches collate to (list of texts, tensor)."""

    def __init__(self, n: int) -> None:
        self.x = make_data(n).tensors[0]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return f"sample {i}", self.x[i]


def test_epoch_mean_weights_by_the_first_tensor_not_by_a_list_of_texts(trainer_kwargs):
    class Texts(Regressor):
        def training_step(self, batch, batch_idx):
            texts, x = batch
            self.log("x0", x[:, 0].mean(), on_step=False, on_epoch=True)
            return self(x).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            texts, x = batch
            self.log("val_x0", x[:, 0].mean())

    data = TextsAndFeatures(20)
    loader = DataLoader(data, batch_size=8)  # (8 texts, 8 rows), (8, 8), (4, 4)
    trainer = Trainer(max_epochs=1, **trainer_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (texts, tensor) is not ambiguous: no warning
        trainer.fit(Texts(), loader, loader)
    assert math.isclose(trainer.callback_metrics["x0"], data.x[:, 0].mean().item(), rel_tol=1e-5)
    assert math.isclose(trainer.callback_metrics["val_x0"], data.x[:, 0].mean().item(), rel_tol=1e-5)


def test_an_ambiguous_batch_warns_once_and_one_without_tensors_needs_a_batch_size(trainer_kwargs):
    class WithMask(Regressor):
        def training_step(self, batch, batch_idx):
            x, y, mask = batch
            self.log("x0", x[:, 0].mean(), on_step=False, on_epoch=True)
            return nn.functional.mse_loss(self(x), y)

    def with_a_longer_mask(samples):  # x and y of n rows, a mask of n + 1: which is the batch size?
        x, y = torch.utils.data.default_collate(samples)
        return x, y, torch.ones(len(samples) + 1)

    loader = make_loader(n=16, batch_size=8, collate_fn=with_a_longer_mask)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(max_epochs=2, **trainer_kwargs)
        trainer.fit(WithMask(), loader)
    ambiguous = [str(w.message) for w in caught if "ambiguous" in str(w.message)]
    assert len(ambiguous) == 1 and "is 8, the length of its first tensor" in ambiguous[0]  # once, not per batch
    assert math.isclose(trainer.callback_metrics["x0"], loader.dataset.tensors[0][:, 0].mean().item(), rel_tol=1e-5)

    class TextsOnly(Regressor):  # batches of texts only: the module makes its tensors itself
        given = None

        def training_step(self, texts, batch_idx):
            x = torch.tensor([[float(len(t))] * 8 for t in texts]).to(self.device)
            self.log("mean_len", x[:, 0].mean(), on_step=False, on_epoch=True, batch_size=self.given)
            return self(x).pow(2).mean()

    texts = DataLoader([f"text number {i}" for i in range(12)], batch_size=4)
    with pytest.raises(ValueError, match=r"^Could not infer the batch size from the batch \(no tensor in it\)"
                                         r".*self\.log\(\.\.\., batch_size=N\)") as info:
        Trainer(max_epochs=1, **trainer_kwargs).fit(TextsOnly(), texts)
    assert "\n" not in str(info.value)
    module = TextsOnly()
    module.given = 4
    trainer = Trainer(max_epochs=1, **trainer_kwargs)
    trainer.fit(module, texts)
    assert math.isclose(trainer.callback_metrics["mean_len"], sum(len(f"text number {i}") for i in range(12)) / 12,
                        rel_tol=1e-6)


@pytest.mark.parametrize("strategy, device", [("auto", "cpu"), ("xla_native", "xla")])
def test_module_properties_inside_fit(trainer_kwargs, strategy, device):
    seen = []

    class Props(Regressor):
        def on_train_epoch_start(self):
            seen.append((self.trainer.global_rank, self.device.type, self.global_step, self.current_epoch))

    trainer = Trainer(strategy=strategy, max_epochs=2, **trainer_kwargs)
    trainer.fit(Props(), make_loader())
    assert seen == [(0, device, 0, 0), (0, device, 8, 1)]
    assert trainer.world_size == 1 and trainer.is_global_zero


def test_dataloaders_from_the_module(trainer_kwargs):
    class WithData(Regressor):
        def train_dataloader(self):
            return make_loader()

        def val_dataloader(self):
            return make_loader(n=16)

    trainer = Trainer(max_epochs=1, **trainer_kwargs)
    trainer.fit(WithData())
    assert "val_loss" in trainer.callback_metrics


def test_epoch_scheduler_and_plateau_monitor(trainer_kwargs):
    class EpochScheduled(Regressor):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1.0)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)]

    trainer = Trainer(max_epochs=3, **trainer_kwargs)
    trainer.fit(EpochScheduled(lr=1.0), make_loader())
    assert math.isclose(trainer.optimizers[0].param_groups[0]["lr"], 1e-3)

    class Plateau(Regressor):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.01)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, threshold=10.0)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}

    trainer = Trainer(max_epochs=3, **trainer_kwargs)
    trainer.fit(Plateau(), make_loader(), make_loader(n=16))
    assert trainer.optimizers[0].param_groups[0]["lr"] < 0.01  # no 10x improvement: reduced
    with pytest.raises(ValueError, match="ReduceLROnPlateau needs"):
        class NoMonitor(Regressor):
            def configure_optimizers(self):
                opt = torch.optim.SGD(self.parameters(), lr=0.01)
                return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt)}

        Trainer(max_epochs=1, **trainer_kwargs).fit(NoMonitor(), make_loader())
