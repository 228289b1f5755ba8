"""Several training loaders read together (Lightning's ``CombinedLoader``; ``fit`` with a dict or a
list of loaders), and several evaluation loaders given as a dict: each step's batch, each
loader's passes, resuming inside an epoch bitwise, replicas' shares, and the refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from xtrainer import Trainer, XModule
from xtrainer.callbacks import ModelCheckpoint
from xtrainer.utilities import CombinedLoader


def numbers(start: int, count: int, **kwargs) -> DataLoader:
    """Batches of 2 of the numbers ``start`` .. ``start + count - 1`` (one column)."""
    return DataLoader(TensorDataset(torch.arange(start, start + count).view(count, 1)), batch_size=2, **kwargs)


def firsts(batch) -> list[int] | None:
    return None if batch is None else batch[0].flatten().tolist()


class Recorder(XModule):
    """Notes each step's batch (by its numbers) and trains on all of it, with a random number
    drawn on the device each step (a resumed run must draw the same ones)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(1, 1)
        self.seen: list[tuple] = []

    def training_step(self, batch, batch_idx):
        parts = list(batch.values()) if isinstance(batch, dict) else list(batch)
        self.seen.append((self.global_step, *(firsts(part) for part in parts)))
        loss = sum(self.net(part[0].float() / 100).pow(2).mean() for part in parts if part is not None)
        return loss * (1 + 0.1 * torch.rand((), device=self.device))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(root, loaders, ckpt_path=None, every_step=False, **kwargs) -> tuple[Recorder, Trainer]:
    module = Recorder()
    callbacks = [ModelCheckpoint(dirpath=root / "ck", every_n_train_steps=1, save_top_k=-1, filename="{step}")] \
        if every_step else []
    trainer = Trainer(strategy=kwargs.pop("strategy", "native"), max_epochs=2, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=every_step, callbacks=callbacks,
                      default_root_dir=root, **kwargs)
    trainer.fit(module, loaders, ckpt_path=ckpt_path)
    return module, trainer


def test_the_modes_read_as_lightning_reads_them():
    a, b = numbers(0, 6), numbers(10, 10)  # 3 and 5 batches
    read = {mode: [(batch, i, d) for batch, i, d in CombinedLoader({"a": a, "b": b}, mode)]
            for mode in ("min_size", "max_size_cycle", "max_size", "sequential")}
    assert [(firsts(x["a"]), firsts(x["b"]), i) for x, i, _ in read["min_size"]] == \
        [([0, 1], [10, 11], 0), ([2, 3], [12, 13], 1), ([4, 5], [14, 15], 2)]
    assert [(firsts(x["a"]), firsts(x["b"])) for x, _, _ in read["max_size_cycle"]] == \
        [([0, 1], [10, 11]), ([2, 3], [12, 13]), ([4, 5], [14, 15]), ([0, 1], [16, 17]), ([2, 3], [18, 19])]
    assert [firsts(x["a"]) for x, _, _ in read["max_size"]] == [[0, 1], [2, 3], [4, 5], None, None]
    assert [(i, d) for _, i, d in read["sequential"]] == \
        [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 1), (4, 1)]
    assert [len(CombinedLoader([a, b], mode)) for mode in ("min_size", "max_size_cycle", "max_size", "sequential")] \
        == [3, 5, 5, 8]
    nested, _, _ = next(iter(CombinedLoader([a, (b, a)], "max_size_cycle")))
    assert isinstance(nested, list) and isinstance(nested[1], tuple) and firsts(nested[1][0]) == [10, 11]
    with pytest.raises(ValueError, match="mode='cycle'"):
        CombinedLoader([a], "cycle")


def test_fit_reads_a_dict_of_loaders_together_each_shorter_one_in_passes_of_its_own(tmp_path):
    module, trainer = fit(tmp_path, {"a": numbers(0, 6, shuffle=True), "b": numbers(100, 14, shuffle=True)})
    assert trainer.num_training_batches == 7 and len(module.seen) == 14
    assert isinstance(trainer.train_dataloader, dict) and list(trainer.train_dataloader) == ["a", "b"]
    for epoch in (0, 1):
        steps = module.seen[7 * epoch:7 * (epoch + 1)]
        assert sorted(x for _, _, b in steps for x in b) == list(range(100, 114))  # the longest: one pass
        passes = [sorted(x for _, a, _ in steps[3 * p:3 * p + 3] for x in a) for p in (0, 1)]
        assert passes == [list(range(6))] * 2  # the shorter one: a whole pass, then again
    first_orders = [[a for _, a, _ in module.seen[3 * p:3 * p + 3]] for p in (0, 1)]
    assert first_orders[0] != first_orders[1]  # each pass draws an order of its own
    assert [b for _, _, b in module.seen[:7]] != [b for _, _, b in module.seen[7:]]  # so does each epoch


@pytest.mark.parametrize("mode", ["max_size_cycle", "list", "max_size", "min_size"])
def test_resuming_inside_an_epoch_continues_every_loader_bitwise(tmp_path, mode):
    """Checkpoints of every step; a fit resumed from several of them (inside a pass of the shorter
    loader, at the end of one, in the second epoch) trains on the same batches to the same weights."""
    def loaders():
        a, b = numbers(0, 6, shuffle=True), numbers(100, 14, shuffle=True)
        return [a, b] if mode == "list" else CombinedLoader({"a": a, "b": b}, mode)

    full, trainer = fit(tmp_path, loaders(), every_step=True)
    steps = 2 * trainer.num_training_batches
    for step in sorted({2, 3, 4, steps // 2 + 1, steps - 2}):
        resumed, _ = fit(tmp_path / f"from{step}", loaders(), ckpt_path=tmp_path / "ck" / f"step={step}.ckpt")
        assert resumed.seen == [s for s in full.seen if s[0] >= step], step
        for p, q in zip(full.parameters(), resumed.parameters()):
            assert torch.equal(p, q), step


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in range(6):
            yield torch.tensor([i])


@pytest.mark.parametrize("mode", ["max_size_cycle", "min_size"])
def test_a_loader_without_a_length_is_read_with_the_others(tmp_path, mode):
    """A stream among them: the epoch lasts until the loaders are through (``max_size_cycle``:
    every one once, the stream started again as it runs out), as in Lightning."""
    stream = DataLoader(_Stream(), batch_size=2)  # 3 batches, no length
    module, trainer = fit(tmp_path, CombinedLoader({"a": stream, "b": numbers(100, 14)}, mode))
    per_epoch = 7 if mode == "max_size_cycle" else 3
    assert [a for _, a, _ in module.seen[:per_epoch]] == ([[0], [2], [4]] * 3)[:per_epoch]
    assert trainer.global_step == 2 * per_epoch


@pytest.mark.multi_device
def test_two_replicas_share_out_each_loader_and_resume_bitwise(tmp_path):
    def loaders():
        return {"a": numbers(0, 12, shuffle=True), "b": numbers(100, 28, shuffle=True)}

    full, trainer = fit(tmp_path, loaders(), strategy="xla_ddp", devices=2, every_step=True)
    assert trainer.global_step == 14  # 14 batches of b, shared out: 7 steps an epoch
    resumed, _ = fit(tmp_path / "resumed", loaders(), strategy="xla_ddp", devices=2,
                     ckpt_path=tmp_path / "ck" / "step=3.ckpt")  # a pass of a's share ends at step 3
    for p, q in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


class FromHooks(Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.reloads = 0

    def train_dataloader(self):
        self.reloads += 1
        return {"a": numbers(0, 4), "b": numbers(10, 6 + 2 * self.reloads)}

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.log("v", batch[0].float().mean())

    def val_dataloader(self):
        return {"first": numbers(0, 4), "second": numbers(50, 2)}


def test_hooks_may_return_dicts_of_loaders(tmp_path):
    module = FromHooks()
    trainer = Trainer(strategy="native", max_epochs=2, reload_dataloaders_every_n_epochs=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      num_sanity_val_steps=0, default_root_dir=tmp_path)
    trainer.fit(module)
    assert module.reloads == 2 and len(module.seen) == 4 + 5  # b grew by one batch on reload
    assert sorted(trainer.callback_metrics) == ["v/dataloader_idx_0", "v/dataloader_idx_1"]
    assert trainer.callback_metrics["v/dataloader_idx_1"].item() == 50.5  # the second loader: its own number


def test_what_cannot_be_read_together_is_refused_with_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="mode='sequential'"):
        fit(tmp_path, CombinedLoader([numbers(0, 4), numbers(0, 4)], "sequential"))
    module, trainer = fit(tmp_path, [numbers(0, 4)])  # a list of one loader is that loader
    assert module.seen[0] == (0, [0])  # the loader's own batch ([x]), not a collection of batches
    with pytest.raises(ValueError, match="pass them as a list"):
        trainer.validate(module, CombinedLoader([numbers(0, 4)], "min_size"))
    empty = DataLoader(TensorDataset(torch.zeros(0, 1)), batch_size=2)
    with pytest.raises(ValueError, match="empty"):
        fit(tmp_path, {"a": numbers(0, 4), "b": empty})
