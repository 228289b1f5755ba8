"""What a launch of several replicas sends to them must survive pickling (spawned processes)."""

import pickle

import pytest
import torch

from conftest import Regressor, make_loader

from xtrainer import Trainer


def test_trainer_module_and_loaders_pickle_for_spawned_replicas(tmp_path):
    trainer = Trainer(strategy="xla_fsdp", default_root_dir=str(tmp_path))
    model = Regressor()
    trainer2, model2, loader2 = pickle.loads(pickle.dumps((trainer, model, make_loader())))
    assert type(trainer2.strategy).__name__ == "XlaFSDP" and len(loader2) == 8
    assert [type(cb).__name__ for cb in trainer2.callbacks] == ["ModelSummary", "XlaHealth", "Goodput", "HangWatchdog",
                                                                "ProgressBar", "ModelCheckpoint"]


class WithGenerator(Regressor):
    """A module holding a ``torch.Generator`` (its own noise source), as some projects do."""

    def __init__(self) -> None:
        super().__init__()
        self.noise = torch.Generator().manual_seed(7)
        torch.rand(3, generator=self.noise)  # drawn from before the fit: its state must travel

    def on_train_start(self) -> None:
        self.first_draw = torch.rand((), generator=self.noise)  # a CPU generator: no device sync

    def training_step(self, batch, batch_idx):
        self.log("first_draw", self.first_draw, on_step=False, on_epoch=True, reduce_fx="max")
        return super().training_step(batch, batch_idx)


@pytest.mark.multi_device
@pytest.mark.parametrize("strategy", ["xla_ddp", "native_ddp"])  # thread replicas; real processes
def test_a_module_holding_a_torch_generator_trains_on_two_devices(tmp_path, strategy):
    """Its state reaches every replica as the caller had it (it is pickled to them)."""
    model = WithGenerator()
    trainer = Trainer(strategy=strategy, devices=2, max_epochs=1, default_root_dir=str(tmp_path), logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(model, make_loader(shuffle=True, generator=torch.Generator().manual_seed(1)))  # a loader's too
    expected = torch.Generator().manual_seed(7)
    torch.rand(3, generator=expected)
    assert trainer.global_step == 4
    assert trainer.callback_metrics["first_draw"] == torch.rand((), generator=expected).item()
