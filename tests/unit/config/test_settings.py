"""The Trainer's settings and their checks (``xtrainer/config/settings.py``), as Lightning's."""

import pytest


def test_max_epochs_minus_one_means_no_limit_as_in_lightning():
    from xtrainer.config.settings import TrainerSettings

    assert TrainerSettings(max_epochs=-1, max_steps=50).check().max_epochs == -1
    assert TrainerSettings(max_epochs=-1).check().max_epochs == -1  # max_steps or max_time ends it
    # Left out: Lightning's default, 1000 epochs, unless max_steps or max_time ends the fit
    assert TrainerSettings(max_steps=50).check().max_epochs == -1
    assert TrainerSettings(max_time="00:00:01:00").check().max_epochs == -1
    assert TrainerSettings().check().max_epochs == 1000
    with pytest.raises(ValueError, match="max_epochs=0 must be a positive int"):
        TrainerSettings(max_epochs=0).check()
