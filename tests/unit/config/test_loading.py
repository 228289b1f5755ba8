"""Loading configurations (``xtrainer/config/loading.py``): files, then the command line, into the
run's schema or one of your own, and the one-line refusals."""

from dataclasses import dataclass, field
from typing import List

import pytest
from omegaconf import OmegaConf

from xtrainer.config import ConfigError, TrainerConfig, load_config, save_config, trainer_kwargs


@dataclass
class Model:
    hidden: int = 8
    lr: float = 0.1


@dataclass
class Config:
    model: Model = field(default_factory=Model)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def test_yaml_then_command_line(tmp_path):
    yaml = tmp_path / "run.yaml"
    yaml.write_text("model:\n  hidden: 32\ntrainer:\n  max_epochs: 3\n  precision: bf16\n")
    cfg = load_config(Config, ["--config", str(yaml), "model.lr=0.5", "trainer.max_epochs=7"])
    assert (cfg.model.hidden, cfg.model.lr) == (32, 0.5)
    assert cfg.trainer.max_epochs == 7 and cfg.trainer.precision == "bf16"
    kwargs = trainer_kwargs(cfg.trainer)
    assert kwargs["max_epochs"] == 7 and kwargs["detect_nonfinite"] == "raise"
    path = save_config(cfg, tmp_path / "run")
    assert OmegaConf.load(path).model.lr == 0.5


def test_a_custom_schema_gets_the_same_checks(tmp_path):
    with pytest.raises(ConfigError, match="Did you mean 'trainer.max_epochs'\\? Valid keys: .*model.hidden"):
        load_config(Config, ["trainer.max_epoch=3"])
    with pytest.raises(ConfigError, match="model.hidden='big' is not a valid int"):
        load_config(Config, ["model.hidden=big"])
    with pytest.raises(ConfigError, match="Unexpected argument '--epochs'"):
        load_config(Config, ["--epochs", "3"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Config, ["--config", str(tmp_path / "nope.yaml")])
    tagged = tmp_path / "tagged.yaml"
    tagged.write_text("model:\n  hidden: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match="tagged.yaml', line 2, column 11: the YAML tag '!!python/object/apply"):
        load_config(Config, ["--config", str(tagged)])


def expect(where: str, message: str):
    """``pytest.raises`` for a ``ConfigError`` matching ``message``, checked to be one line."""
    class OneLine:
        def __enter__(self):
            self.raises = pytest.raises(ConfigError, match=message)
            self.info = self.raises.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self.raises.__exit__(*exc)
            assert "\n" not in str(self.info.value) and str(self.info.value).startswith(where)
            return handled
    return OneLine()


# ---- a schema of your own --------------------------------------------------------------------------
@dataclass
class Sweep:
    lr: float = 0.1
    steps: int = 10
    tags: List[str] = field(default_factory=list)


def test_load_config_fills_a_schema_and_names_a_wrong_key():
    assert load_config(Sweep, ["lr=0.5", "tags=[a, b]"]) == Sweep(0.5, 10, ["a", "b"])
    with expect("", r"steps"):
        load_config(Sweep, ["step=3"])
    with expect("", r"steps='many' is not a valid int"):
        load_config(Sweep, ["steps=many"])
