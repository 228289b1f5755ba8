"""``Results`` on its own (no Trainer, no training): what ``self.log`` keeps per step and per
epoch, the reductions, ``sync_dist`` across replicas (two stores, reduced as a collective would
reduce them), and a store saved and restored inside an epoch. Host tensors: the arithmetic is the
same on the device, where the story tests run it."""

import math

import pytest
import torch

from xtrainer.loop.results import REDUCE_FXS, Results, batch_size, to_floats


def no_reduce(tensor, op):
    raise AssertionError("a single replica reduces nothing")


def train_store() -> Results:
    results = Results("train", default_on_step=True)
    results.begin_batch(torch.zeros(1))  # values logged from a step of a one-row batch
    return results


def floats(tensors):
    return to_floats(tensors, lambda t: t)


def test_train_defaults_are_per_step_and_on_epoch_adds_the_epoch_value():
    results = train_store()
    for value in (1.0, 3.0):
        results.log("loss", torch.tensor(value), None, None, False, False, "mean", None)
        results.log("acc", torch.tensor(value), True, True, False, False, "mean", None)
    assert floats(results.step_tensors(no_reduce, 1)) == {"loss": 3.0, "acc_step": 3.0}
    assert floats(results.epoch_tensors(no_reduce, 1)) == {"acc_epoch": 2.0}


def test_evaluation_values_are_per_epoch_whatever_on_step_says():
    results = Results("validate", default_on_step=False)
    results.begin_batch(torch.zeros(1))  # values logged from a step of a one-row batch
    results.log("val_loss", torch.tensor(2.0), True, False, False, False, "mean", None)
    results.log("val_loss", torch.tensor(4.0), True, False, False, False, "mean", None)
    assert results.step_tensors(no_reduce, 1) == {}
    assert floats(results.epoch_tensors(no_reduce, 1)) == {"val_loss": 3.0}


def test_an_evaluation_value_asked_for_per_step_and_per_epoch_is_named_as_in_lightning():
    """on_step=True (on_epoch left to its default, True): x_epoch, and x among the plain names
    (callback_metrics); its per-batch values are not published."""
    results = Results("test", default_on_step=False)
    results.begin_batch(torch.zeros(1))
    results.log("test_loss", torch.tensor(2.0), True, None, False, False, "mean", None)
    results.log("test_loss", torch.tensor(4.0), True, None, False, False, "mean", None)
    epoch = results.epoch_tensors(no_reduce, 1)
    assert floats(epoch) == {"test_loss_epoch": 3.0}
    assert floats(results.plain_names(epoch)) == {"test_loss": 3.0}


@pytest.mark.parametrize("reduce_fx, expected", [("mean", (1 * 2 + 4 * 6) / 8), ("sum", 5.0), ("max", 4.0),
                                                  ("min", 1.0), (torch.max, 4.0), (sum, 5.0)])
def test_epoch_reductions_and_the_mean_weighted_by_batch_size(reduce_fx, expected):
    results = train_store()
    results.log("x", torch.tensor(1.0), False, True, False, False, reduce_fx, 2)
    results.batch_size = 6  # inferred from the batch when batch_size is not given
    results.log("x", 4, False, True, False, False, reduce_fx, None)
    assert floats(results.epoch_tensors(no_reduce, 1)) == {"x": pytest.approx(expected)}


def test_max_and_min_start_from_their_identity_not_from_zero():
    results = train_store()
    results.log("hi", torch.tensor(-5.0), False, True, False, False, "max", None)
    results.log("lo", torch.tensor(7.0), False, True, False, False, "min", None)
    assert floats(results.epoch_tensors(no_reduce, 1)) == {"hi": -5.0, "lo": 7.0}


def test_a_value_logged_outside_a_step_is_the_epoch_value_as_given():
    results = train_store()
    results.in_step = False  # an epoch hook
    results.log("lr", 0.5, True, False, False, False, "mean", None)
    results.log("lr", 0.25, True, False, False, False, "mean", None)  # replaces, is not averaged in
    assert results.step_tensors(no_reduce, 1) == {}
    assert floats(results.epoch_tensors(no_reduce, 1)) == {"lr": 0.25}


def test_reset_epoch_forgets_the_epoch_but_keeps_the_names():
    results = train_store()
    results.log("x", torch.tensor(3.0), True, True, True, False, "sum", None)
    results.reset_epoch()
    assert results.epoch_tensors(no_reduce, 1) == {}
    results.log("x", torch.tensor(1.0), True, True, True, False, "sum", None)
    assert floats(results.epoch_tensors(no_reduce, 1)) == {"x_epoch": 1.0}
    assert results.prog_bar_names() == {"x", "x_step", "x_epoch"}


def test_logger_false_hides_every_variant_of_the_name():
    results = train_store()
    results.log("secret", torch.tensor(1.0), True, True, False, False, "mean", None, logger=False)
    results.log("shown", torch.tensor(1.0), True, False, False, False, "mean", None)
    assert results.hidden_from_loggers() == {"secret", "secret_step", "secret_epoch"}


def test_a_second_dataloader_suffixes_the_name_unless_asked_not_to():
    results = Results("validate", default_on_step=False)
    results.begin_batch(torch.zeros(1))
    results.suffix = "/dataloader_idx_1"
    results.log("a", torch.tensor(1.0), None, None, False, False, "mean", None)
    results.log("b", torch.tensor(1.0), None, None, False, False, "mean", None, add_dataloader_idx=False)
    assert set(results.epoch_tensors(no_reduce, 1)) == {"a/dataloader_idx_1", "b"}


def test_sync_dist_reduces_across_replicas_and_without_it_each_keeps_its_own():
    """Two replicas' stores; ``reduce`` does what the collective does: combines the same entry
    of every replica (both call it in the same order, as replicas run the same program)."""
    stores = [train_store(), train_store()]
    for rank, store in enumerate(stores):
        for step in range(2):
            value = torch.tensor(float(10 * rank + step))  # rank 0: 0, 1; rank 1: 10, 11
            store.log("synced_mean", value, True, True, False, True, "mean", 4)
            store.log("synced_max", value, False, True, False, True, "max", None)
            store.log("synced_sum", value, False, True, False, True, "sum", None)
            store.log("local", value, False, True, False, False, "mean", 4)

    def inputs(store):
        """What ``store`` hands the collective, in order (each ``reduce`` returns its input here)."""
        given = []
        store.epoch_tensors(lambda tensor, op: given.append((tensor, op)) or tensor, 2)
        return given

    calls0, calls1 = inputs(stores[0]), inputs(stores[1])
    assert [op for _, op in calls0] == [op for _, op in calls1] == ["sum", "max", "sum"]
    # what the all-reduce gives every replica back: the reduction over both replicas' inputs
    combine = {"sum": lambda a, b: a + b, "max": torch.maximum}
    reduced = [combine[op](a, b) for (a, op), (b, _) in zip(calls0, calls1)]

    def epoch(store, reduced_values):
        it = iter(reduced_values)
        return floats(store.epoch_tensors(lambda tensor, op: next(it), 2))

    for store in stores:
        got = epoch(store, reduced)
        assert got["synced_mean_epoch"] == pytest.approx((0 + 1 + 10 + 11) / 4)  # weight counts both replicas
        assert got["synced_max"] == 11.0 and got["synced_sum"] == 22.0
    assert epoch(stores[0], reduced)["local"] == 0.5 and epoch(stores[1], reduced)["local"] == 10.5
    # per step: the mean over replicas of each one's latest value
    latest = stores[0].entries["synced_mean"].last + stores[1].entries["synced_mean"].last
    step = floats(stores[0].step_tensors(lambda tensor, op: latest, 2))
    assert step == {"synced_mean_step": (1 + 11) / 2}


def test_one_replica_never_reduces_even_with_sync_dist():
    results = train_store()
    results.log("x", torch.tensor(2.0), True, True, False, True, "mean", None)
    assert floats(results.step_tensors(no_reduce, 1)) == {"x_step": 2.0}
    assert floats(results.epoch_tensors(no_reduce, 1)) == {"x_epoch": 2.0}


def test_state_dict_round_trip_continues_the_epoch():
    results = train_store()
    results.log("loss", torch.tensor(1.0), True, True, True, True, "mean", 2)
    results.log("worst", torch.tensor(5.0), False, True, False, False, "max", None, logger=False)
    results.log("only_step", torch.tensor(9.0), True, False, False, False, "mean", None)
    moved = []
    state = results.state_dict(lambda tensors: moved.append(sorted(tensors)) or tensors)
    assert moved == [["loss", "worst"]]  # one transfer, epoch accumulators only
    assert set(state) == {"loss", "worst"} and state["loss"]["weight"] == 2.0

    resumed = train_store()
    resumed.load_state_dict(state, torch.device("cpu"))
    resumed.log("loss", torch.tensor(4.0), True, True, True, True, "mean", 2)
    resumed.log("worst", torch.tensor(3.0), False, True, False, False, "max", None, logger=False)
    got = floats(resumed.epoch_tensors(no_reduce, 1))
    assert got == {"loss_epoch": 2.5, "worst": 5.0}  # over the whole epoch, before and after the resume
    assert resumed.prog_bar_names() == {"loss", "loss_step", "loss_epoch"}
    assert "worst" in resumed.hidden_from_loggers() and resumed.entries["loss"].sync_dist


def test_load_state_dict_skips_what_is_not_of_this_format():
    results = train_store()
    results.load_state_dict({"old": {"reduce_fx": "median", "total": torch.tensor([1.0])},
                             "broken": {"reduce_fx": "mean", "total": 1.0}}, torch.device("cpu"))
    results.load_state_dict(None, torch.device("cpu"))
    assert results.entries == {}


@pytest.mark.parametrize("value, kwargs, error, message", [
    (torch.tensor(1.0), {"reduce_fx": "median"}, ValueError, r"reduce_fx='median'\): use one of"),
    (torch.tensor([1.0, 2.0]), {}, ValueError, r"takes a scalar, got a tensor of shape \(2,\)"),
    ("1.0", {}, TypeError, "takes a scalar tensor or a number, not str"),
    (1j, {}, TypeError, "not complex"),
    (torch.tensor(1.0), {"on_step": False, "on_epoch": False}, ValueError, "logs nothing"),
])
def test_malformed_logs_are_refused_with_one_line(value, kwargs, error, message):
    args = {"on_step": None, "on_epoch": None, "prog_bar": False, "sync_dist": False, "reduce_fx": "mean",
            "batch_size": None, **kwargs}
    with pytest.raises(error, match=message) as info:
        train_store().log("x", value, **args)
    assert "\n" not in str(info.value)
    assert set(REDUCE_FXS) == {"mean", "sum", "max", "min"}


def test_numbers_of_python_and_numpy_and_bools_are_logged_as_lightning_logs_them():
    import numpy as np

    store = train_store()
    for i, value in enumerate([np.float32(0.25), np.int64(3), True, np.float64(0.5), 7]):
        store.log(f"x{i}", value, None, None, False, False, "mean", None)
    assert {k: float(v) for k, v in store.step_tensors(lambda t, op: t, 1).items()} == \
        {"x0": 0.25, "x1": 3.0, "x2": 1.0, "x3": 0.5, "x4": 7.0}


@pytest.mark.parametrize("value, kwargs, error, message", [
    (torch.tensor([1.0, 2.0]), {}, ValueError, r"takes a scalar, got a tensor of shape \(2,\)"),
    (torch.tensor(1.0), {"reduce_fx": "median"}, ValueError, r"reduce_fx='median'\): use one of"),
    ("1.0", {}, TypeError, "takes a scalar tensor or a number, not str"),
])
def test_a_malformed_value_is_refused_also_under_a_name_logged_before(value, kwargs, error, message):
    """A name logged per step again (the call every step makes) is checked as the first time."""
    store = train_store()
    store.log("x", torch.tensor(1.0), None, None, False, False, "mean", None)
    args = {"on_step": None, "on_epoch": None, "prog_bar": False, "sync_dist": False, "reduce_fx": "mean",
            "batch_size": None, **kwargs}
    with pytest.raises(error, match=message):
        store.log("x", value, **args)


def test_a_value_logged_again_each_step_is_kept_detached_0_dim_and_float32():
    store = train_store()
    grad = torch.tensor(5.0, requires_grad=True)
    for value in (torch.tensor(1.0), torch.tensor([2.0]), torch.tensor(3), torch.tensor(4.0, dtype=torch.bfloat16),
                  grad * 1, 6.0):
        store.log("x", value, None, None, False, False, "mean", None)
        kept = store.step_tensors(no_reduce, 1)["x"]
        assert (kept.shape, kept.dtype, kept.requires_grad) == ((), torch.float32, False)
        assert kept.item() == float(value.detach() if isinstance(value, torch.Tensor) else value)


def test_batch_size_is_dim_0_of_the_first_tensor_found():
    assert batch_size(torch.zeros(5, 3)) == 5
    assert batch_size(torch.tensor(2.0)) == 1
    assert batch_size({"ids": torch.zeros(7, 2), "mask": torch.zeros(3)}) == 7
    assert batch_size(([torch.zeros(4)], torch.zeros(9))) == 4
    assert batch_size(["no tensors"]) == 1
    assert batch_size((["a", "b", "c"], torch.zeros(3, 2))) == 3  # (texts, tensor): the tensor's length
    numpy = pytest.importorskip("numpy")
    assert batch_size((numpy.zeros((10**7,)), torch.zeros(6))) == 6  # an array is a leaf, not walked
    with pytest.raises(ValueError, match="no tensor in it"):
        batch_size(["no tensors"], strict=True)
    assert math.isinf(float(Results("train", True)._constant(-math.inf, torch.device("cpu"))))


def _epoch_value(replicas: list[Results], name: str) -> float:
    """The epoch value rank 0 logs, its reduction across ``replicas`` made as the collectives would."""
    totals = [r.entries[name].total for r in replicas]
    ops = {"sum": lambda: torch.stack(totals).sum(), "max": lambda: torch.stack(totals).max(),
           "min": lambda: torch.stack(totals).min()}
    return floats(replicas[0].epoch_tensors(lambda t, op: ops[op](), len(replicas)))[name]


def _log_batches(replicas: list[Results], values: list[float], fx: str, sync: bool) -> None:
    """``values`` dealt to the replicas in turn, one batch of two rows each."""
    for i, value in enumerate(values):
        r = replicas[i % len(replicas)]
        r.begin_batch(torch.zeros(2))
        r.log("m", torch.tensor(value), on_step=False, on_epoch=True, prog_bar=False, sync_dist=sync,
              reduce_fx=fx, batch_size=None)
        r.in_step = False


@pytest.mark.parametrize("fx", REDUCE_FXS)
@pytest.mark.parametrize("resumed_by", [1, 2, 4])
def test_an_epoch_resumed_by_another_number_of_replicas_keeps_the_values_logged_before(fx, resumed_by):
    """Two replicas log synced epoch values over 8 batches, a checkpoint is written, and the epoch
    goes on over 8 more on ``resumed_by`` replicas: the epoch value is that of the 16 batches."""
    from xtrainer.loop.results import epoch_results_of_replica

    before, after = [float(v) for v in (3, -1, 4, 1, -5, 9, 2, 6)], [float(v) for v in (5, 3, -2, 8, 7, 7, 6, 3)]
    saving = [Results("train", default_on_step=True) for _ in range(2)]
    _log_batches(saving, before, fx, sync=True)
    saved = [r.state_dict(lambda t: t) for r in saving]
    resumed = [Results("train", default_on_step=True) for _ in range(resumed_by)]
    for rank, r in enumerate(resumed):
        r.load_state_dict(epoch_results_of_replica(saved, rank, resumed_by), torch.device("cpu"))
    _log_batches(resumed, after, fx, sync=True)
    every = torch.tensor(before + after)
    expected = {"mean": every.mean(), "sum": every.sum(), "max": every.max(), "min": every.min()}[fx]
    assert _epoch_value(resumed, "m") == pytest.approx(float(expected), rel=1e-6)


def test_an_epoch_resumed_by_another_number_of_replicas_goes_on_from_the_average_share_without_sync():
    from xtrainer.loop.results import epoch_results_of_replica

    saving = [Results("train", default_on_step=True) for _ in range(2)]
    _log_batches(saving, [1.0, 3.0, 1.0, 3.0], "mean", sync=False)  # rank 0 saw 1s, rank 1 3s
    saved = [r.state_dict(lambda t: t) for r in saving]
    alone = Results("train", default_on_step=True)
    alone.load_state_dict(epoch_results_of_replica(saved, 0, 1), torch.device("cpu"))
    assert floats(alone.epoch_tensors(no_reduce, 1))["m"] == 2.0  # both replicas' values, not rank 0's alone
    assert epoch_results_of_replica(saved, 1, 2) is saved[1]  # as many replicas: each its own
    assert epoch_results_of_replica(None, 0, 1) is None and epoch_results_of_replica([], 0, 2) is None
