"""What a launch of several replicas sends to them must survive pickling (spawned processes)."""

import pickle

from conftest import Regressor, make_loader

from xtrainer import Trainer


def test_trainer_module_and_loaders_pickle_for_spawned_replicas(tmp_path):
    trainer = Trainer(strategy="xla_fsdp", default_root_dir=str(tmp_path))
    model = Regressor()
    trainer2, model2, loader2 = pickle.loads(pickle.dumps((trainer, model, make_loader())))
    assert type(trainer2.strategy).__name__ == "XlaFSDP" and len(loader2) == 8
    assert [type(cb).__name__ for cb in trainer2.callbacks] == ["ModelCheckpoint", "XlaHealth", "Goodput", "HangWatchdog", "ProgressBar"]
