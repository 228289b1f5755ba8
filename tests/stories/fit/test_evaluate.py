"""validate / test / predict."""

import math

import pytest
import torch
from conftest import Regressor, make_loader
from torch import nn

from xtrainer import Trainer


def mse(model, loader):
    with torch.no_grad():
        x, y = loader.dataset.tensors
        return nn.functional.mse_loss(model(x), y).item()


def test_validate_returns_one_dict_per_loader(trainer_kwargs):
    model = Regressor()
    loader = make_loader(n=40, batch_size=8)
    results = Trainer(**trainer_kwargs).validate(model, loader)
    assert len(results) == 1 and set(results[0]) == {"val_loss"}
    assert math.isclose(results[0]["val_loss"], mse(model, loader), rel_tol=1e-5)
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_validate_several_loaders(trainer_kwargs):
    model = Regressor()
    loaders = [make_loader(n=16, seed=1), make_loader(n=24, seed=2)]
    results = Trainer(**trainer_kwargs).validate(model, loaders)
    assert [set(r) for r in results] == [{"val_loss/dataloader_idx_0"}, {"val_loss/dataloader_idx_1"}]
    for i, (r, loader) in enumerate(zip(results, loaders)):
        assert math.isclose(r[f"val_loss/dataloader_idx_{i}"], mse(model, loader), rel_tol=1e-5)


class NamesEachLoader(Regressor):
    """Logs one value per loader under a name of its own (``add_dataloader_idx=False``), one with
    the loader's suffix, and one both loaders share."""

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log(f"loss_of_{'ab'[dataloader_idx]}", loss, add_dataloader_idx=False)
        self.log("loss", loss)
        self.log("shared", loss, add_dataloader_idx=False)


def test_several_loaders_each_result_holds_what_was_logged_in_its_loader(trainer_kwargs):
    """As in Lightning: a value logged with add_dataloader_idx=False is in the result of the
    loader it was logged in, not in every loader's."""
    model = NamesEachLoader()
    loaders = [make_loader(n=16, seed=1), make_loader(n=24, seed=2)]
    results = Trainer(**trainer_kwargs).test(model, loaders, verbose=False)
    assert [set(r) for r in results] == [{"loss_of_a", "loss/dataloader_idx_0", "shared"},
                                         {"loss_of_b", "loss/dataloader_idx_1", "shared"}]
    for i, (r, loader) in enumerate(zip(results, loaders)):
        assert math.isclose(r[f"loss_of_{'ab'[i]}"], mse(model, loader), rel_tol=1e-5)


def test_test_with_limit(trainer_kwargs):
    model = Regressor()
    loader = make_loader(n=64, batch_size=8)
    results = Trainer(limit_test_batches=2, **trainer_kwargs).test(model, loader)
    x, y = loader.dataset.tensors
    with torch.no_grad():
        expected = nn.functional.mse_loss(model(x[:16]), y[:16]).item()
    assert math.isclose(results[0]["test_loss"], expected, rel_tol=1e-5)


def test_predict_returns_cpu_outputs(trainer_kwargs):
    model = Regressor()
    loader = make_loader(n=20, batch_size=8)
    outputs = Trainer(**trainer_kwargs).predict(model, loader)
    assert [o.shape for o in outputs] == [(8, 1), (8, 1), (4, 1)]
    assert all(o.device.type == "cpu" for o in outputs)
    with torch.no_grad():
        assert torch.allclose(torch.cat(outputs), model(loader.dataset.tensors[0]), atol=1e-5)


def test_validate_without_validation_step_fails_clearly(trainer_kwargs):
    class NoVal(Regressor):
        validation_step = Regressor.__mro__[1].validation_step  # XModule's

    with pytest.raises(ValueError, match="no validation_step"):
        Trainer(**trainer_kwargs).validate(NoVal(), make_loader())
