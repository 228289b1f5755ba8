"""EarlyStopping: patience, min_delta, threshold, non-finite values, and its state across a resume."""

import math
import os

import pytest
from conftest import Regressor, make_loader

from xtrainer import Trainer
from xtrainer.callbacks import EarlyStopping, ModelCheckpoint
from xtrainer.checkpoint import load_checkpoint


class Scripted(Regressor):
    """Logs ``score`` = ``scores[epoch]`` from validation (or from training when ``in_train``)."""

    def __init__(self, scores, in_train=False):
        super().__init__()
        self.scores, self.in_train = scores, in_train

    def on_validation_epoch_end(self):
        if not self.in_train:
            self.log("score", self.scores[self.current_epoch])

    def on_train_epoch_end(self):
        if self.in_train:
            self.log("score", self.scores[self.current_epoch])


def fit(tmp_path, scores, stopper, epochs=10, validate=True, in_train=False, ckpt_path=None, callbacks=()):
    trainer = Trainer(max_epochs=epochs, default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False,
                      callbacks=[stopper, *callbacks], enable_checkpointing=bool(callbacks))
    trainer.fit(Scripted(scores, in_train), make_loader(n=16), make_loader(n=16) if validate else None,
                ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("mode, scores, patience, min_delta, epochs_run", [
    ("min", [5, 4, 4, 4, 4, 4, 4], 2, 0.0, 4),          # best at epoch 1, two flat epochs
    ("min", [5, 4.95, 4.93, 4.91, 4.5, 4.4], 3, 0.1, 4),  # gains within min_delta of the best
    ("max", [1, 2, 3, 2, 4, 5, 6, 7, 8, 9], 2, 0.0, 10),  # one bad epoch is within patience
])
def test_patience_and_min_delta(tmp_path, mode, scores, patience, min_delta, epochs_run):
    stopper = EarlyStopping("score", mode=mode, patience=patience, min_delta=min_delta)
    trainer = fit(tmp_path, scores, stopper, epochs=len(scores))
    assert trainer.current_epoch == epochs_run
    assert trainer.should_stop == (epochs_run < len(scores))


def test_threshold_and_non_finite_values_stop_at_once(tmp_path):
    stopper = EarlyStopping("score", mode="max", patience=100, stopping_threshold=0.9)
    trainer = fit(tmp_path / "a", [0.5, 0.95, 0.96, 0.97], stopper)
    assert trainer.current_epoch == 2 and "Stopping threshold reached: score = 0.9" in stopper.stop_reason
    stopper = EarlyStopping("score", patience=100)
    trainer = fit(tmp_path / "b", [3, 2, math.nan, 1], stopper)
    assert trainer.current_epoch == 3 and "not finite" in stopper.stop_reason


def test_without_validation_it_checks_at_the_end_of_each_training_epoch(tmp_path):
    stopper = EarlyStopping("score", patience=1)
    trainer = fit(tmp_path, [3, 2, 2, 2], stopper, validate=False, in_train=True)
    assert trainer.current_epoch == 3


def test_counters_are_saved_and_restored(tmp_path):
    scores = [5, 4, 4, 4, 4, 4]
    saver = ModelCheckpoint(save_top_k=-1)
    fit(tmp_path, scores, EarlyStopping("score", patience=3), epochs=3, callbacks=[saver])
    state = load_checkpoint(os.path.join(saver.dirpath, "last.ckpt"))["callbacks"]
    stopper = EarlyStopping("score", patience=3)
    assert state[stopper.state_key]["wait_count"] == 1 and state[stopper.state_key]["best_score"] == 4
    trainer = fit(tmp_path, scores, stopper, epochs=6, ckpt_path="last",
                  callbacks=[ModelCheckpoint(dirpath=saver.dirpath)])
    assert trainer.current_epoch == 5  # 2 more flat epochs after the resume reach patience 3


def test_bad_arguments_and_a_missing_metric(tmp_path):
    with pytest.raises(ValueError, match="mode='best'"):
        EarlyStopping("score", mode="best")
    with pytest.raises(ValueError, match="patience=-1"):
        EarlyStopping("score", patience=-1)
    # a negative min_delta counts a slightly worse value as an improvement, as in Lightning
    trainer = fit(tmp_path / "negative", [1.0, 1.005, 1.01, 1.2, 1.2, 1.2], EarlyStopping("score", min_delta=-0.01,
                                                                                       patience=2), epochs=6)
    assert trainer.current_epoch == 5  # 1.005 and 1.01 improved; 1.2 twice did not
    with pytest.raises(KeyError, match="EarlyStopping\\(monitor='val_acc'\\).*Logged: .*score"):
        fit(tmp_path, [1, 2], EarlyStopping("val_acc"))
