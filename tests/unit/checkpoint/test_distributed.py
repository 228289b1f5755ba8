"""The one reader of optimizer state from a distributed checkpoint
(``checkpoint.distributed.read_optimizer_state``), for both planners that write one: torch's own
(``native_fsdp``), which saves ``param_groups`` item by item under int list indices, and torch_xla's
SPMD one (``xla_spmd``, ``xla_fsdpv2``), which saves it whole. Nothing is trained: an optimizer
steps once on a hand-made gradient, its state is saved as those strategies save it (one process),
and read back."""

import pytest
import torch
from conftest import HAS_XLA

from xtrainer.checkpoint import distributed
from xtrainer.checkpoint.format import OPTIMIZER_STATES, STATE_DICT, CheckpointError

PLANNERS = [pytest.param(False, id="torch"),
            pytest.param(True, id="xla_spmd", marks=pytest.mark.skipif(not HAS_XLA, reason="needs torch_xla"))]


def _stepped_adam() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    optimizer = torch.optim.Adam([{"params": model[0].parameters(), "lr": 0.1},
                                  {"params": model[1].parameters(), "lr": 0.01, "weight_decay": 0.5}])
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    return model, optimizer


def _plain_zeros(param: torch.Tensor, entry: distributed.DistributedEntry) -> torch.Tensor:
    return torch.zeros(entry.shape, dtype=entry.dtype)


@pytest.mark.parametrize("spmd", PLANNERS)
def test_the_optimizer_state_reads_back_as_saved_whichever_planner_wrote_it(tmp_path, spmd):
    model, optimizer = _stepped_adam()
    saved = optimizer.state_dict()
    distributed._save_state({STATE_DICT: model.state_dict(), OPTIMIZER_STATES: [saved]}, str(tmp_path), 0, spmd)
    entries = distributed.entries(str(tmp_path))["optimizer_states.0"]
    groups = {entry.where for entry in entries if entry.where[0] == "param_groups"}
    # Why the reader rebuilds lists: torch's planner goes into the list, torch_xla's keeps it whole.
    assert groups == ({("param_groups",)} if spmd else {("param_groups", i, key) for i in (0, 1) for key in saved["param_groups"][i]})
    params = list(model.parameters())
    part = distributed.DistributedPart(str(tmp_path), "optimizer_states.0", tuple(entries))

    read = distributed.read_optimizer_state(part, params, _plain_zeros, spmd=spmd)

    assert read["param_groups"] == saved["param_groups"]
    assert sorted(read["state"]) == sorted(saved["state"]) == [0, 1, 2, 3]
    for index, values in saved["state"].items():
        assert read["state"][index].keys() == values.keys()
        for name, value in values.items():
            assert torch.equal(read["state"][index][name], value), (index, name)
    fresh = _stepped_adam()[1]
    fresh.load_state_dict(read)
    assert fresh.param_groups[1]["weight_decay"] == 0.5 and fresh.param_groups[0]["lr"] == 0.1

    with pytest.raises(CheckpointError, match=r"holds optimizer state for parameter [23], but the optimizer has 2 parameters"):
        distributed.read_optimizer_state(part, params[:2], _plain_zeros, spmd=spmd)
