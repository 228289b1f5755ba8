"""What a multi-replica launch relies on, checked in one process.

Several replicas cannot run on the CPU runtime yet, so ``torch_xla.launch`` is replaced by a
launcher that runs the single replica this machine has, the way ``torch_xla.launch`` calls it
(``fn(index, *args)`` in the same process, as its CPU thread mode does). Training is real.
"""

import os
import pickle

import torch
from conftest import Regressor, make_loader
from tbparse import SummaryReader

import xtrainer.strategies.base as base
from xtrainer import Trainer, _xla
from xtrainer.callbacks import ModelCheckpoint


def test_trainer_module_and_loaders_pickle_for_spawned_replicas(tmp_path):
    trainer = Trainer(strategy="xla_fsdp", default_root_dir=str(tmp_path))
    model = Regressor()
    trainer2, model2, loader2 = pickle.loads(pickle.dumps((trainer, model, make_loader())))
    assert type(trainer2.strategy).__name__ == "XlaFSDP" and len(loader2) == 8
    assert [type(cb).__name__ for cb in trainer2.callbacks] == ["ModelCheckpoint", "ProgressBar"]


def test_rank_zero_results_come_back_to_the_calling_process(tmp_path, monkeypatch):
    monkeypatch.setattr(base, "_check_multi_replica_supported", lambda devices: None)
    monkeypatch.setattr(_xla, "launch", lambda fn, args: fn(0, *args))

    expected = Regressor()
    Trainer(max_epochs=2, default_root_dir=str(tmp_path / "one"), enable_progress_bar=False,
            logger=False).fit(expected, make_loader(), make_loader(n=16))

    model = Regressor()
    before = [p.detach().clone() for p in model.parameters()]
    saver = ModelCheckpoint()
    trainer = Trainer(devices=2, max_epochs=2, default_root_dir=str(tmp_path / "two"), enable_progress_bar=False,
                      callbacks=[saver])
    trainer.fit(model, make_loader(), make_loader(n=16))
    # the replica trained a copy; its weights, counters, metrics and callback state came back
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    for a, b in zip(expected.parameters(), model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    assert trainer.global_step == 16 and trainer.current_epoch == 2
    assert set(trainer.callback_metrics) == {"train_loss_step", "train_loss_epoch", "val_loss"}
    assert os.path.exists(saver.best_model_path)
    results = trainer.validate(model, make_loader(n=16))
    assert results[0]["val_loss"] == trainer.callback_metrics["val_loss"]

    events = SummaryReader(trainer.log_dir).scalars
    assert set(events["tag"]) >= {"train_loss_epoch", "val_loss"}
    assert events[events.tag == "val_loss"].step.tolist() == [8, 16, 16]  # two epochs, then validate()
