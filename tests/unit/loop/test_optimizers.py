"""``configure_optimizers``' return forms (``xtrainer.loop.optimizers.parse_optimizers``) on their own: every
form Lightning documents, what each scheduler entry becomes, and every refusal with its message;
then ``step_schedulers``. No Trainer and no training: real optimizers and schedulers over a few
host parameters."""

import warnings

import pytest
import torch

from xtrainer.loop.optimizers import NoOptimizer, SchedulerConfig, parse_optimizers, step_schedulers


def sgd(lr: float = 0.1) -> torch.optim.SGD:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def step_lr(optimizer, step_size: int = 1) -> torch.optim.lr_scheduler.StepLR:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=step_size, gamma=0.5)


def parse(config, automatic: bool = True):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an accepted form gives no warning
        return parse_optimizers(config, "Model", automatic)


def test_one_optimizer():
    opt = sgd()
    assert parse(opt) == ([opt], [])


def test_a_list_or_tuple_of_optimizers_needs_manual_optimization():
    a, b = sgd(), sgd()
    assert parse([a, b], automatic=False) == ([a, b], [])
    assert parse((a,)) == ([a], [])
    with pytest.raises(ValueError, match=r"Model.configure_optimizers\(\) gave 2 optimizers. Several optimizers "
                                         "need manual optimization.*automatic_optimization = False"):
        parse([a, b])


def test_two_lists_and_a_list_with_one_scheduler():
    a, b = sgd(), sgd()
    sa, sb = step_lr(a), step_lr(b)
    optimizers, schedulers = parse(([a, b], [sa, sb]), automatic=False)
    assert optimizers == [a, b] and [s.scheduler for s in schedulers] == [sa, sb]
    assert all(s.interval == "epoch" and s.frequency == 1 and s.monitor is None for s in schedulers)
    optimizers, [only] = parse(([a], sa))  # the second item may be one scheduler
    assert optimizers == [a] and only.scheduler is sa


def test_a_dict_with_a_bare_scheduler_or_a_scheduler_dict():
    opt = sgd()
    scheduler = step_lr(opt)
    assert parse({"optimizer": opt}) == ([opt], [])
    assert parse({"optimizer": opt, "lr_scheduler": None}) == ([opt], [])
    _, [config] = parse({"optimizer": opt, "lr_scheduler": scheduler})
    assert config == SchedulerConfig(scheduler)
    _, [config] = parse({"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step",
                                                            "frequency": 3, "name": "lr-main", "strict": False}})
    assert config == SchedulerConfig(scheduler, "step", 3, None, False, "lr-main", False)


def test_reduce_on_plateau_takes_the_monitor_from_either_level():
    opt = sgd()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    _, [top] = parse({"optimizer": opt, "lr_scheduler": plateau, "monitor": "val_loss"})
    _, [inner] = parse({"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val_acc"},
                        "monitor": "val_loss"})
    assert (top.monitor, top.reduce_on_plateau) == ("val_loss", True)
    assert inner.monitor == "val_acc"  # the scheduler's own wins
    with pytest.raises(ValueError, match="ReduceLROnPlateau needs a metric to monitor"):
        parse({"optimizer": opt, "lr_scheduler": plateau})


def test_a_list_of_dicts_gives_each_scheduler_its_own_monitor():
    a, b = sgd(), sgd()
    sa, sb = step_lr(a), torch.optim.lr_scheduler.ReduceLROnPlateau(b)
    optimizers, schedulers = parse([{"optimizer": a, "lr_scheduler": sa},
                                    {"optimizer": b, "lr_scheduler": {"scheduler": sb}, "monitor": "val_loss"}],
                                   automatic=False)
    assert optimizers == [a, b]
    assert [(s.scheduler, s.monitor) for s in schedulers] == [(sa, None), (sb, "val_loss")]


def test_none_runs_with_no_optimizer_and_says_so():
    with pytest.warns(UserWarning, match=r"Model.configure_optimizers\(\) returned None: this fit runs with no "
                                         "optimizer"):
        [optimizer], schedulers = parse_optimizers(None, "Model")
    assert isinstance(optimizer, NoOptimizer) and schedulers == []
    assert optimizer.step(lambda: 7) == 7 and optimizer.step() is None
    optimizer.zero_grad()


def test_unknown_keys_are_ignored_with_a_warning():
    opt = sgd()
    with pytest.warns(UserWarning, match=r"unknown keys \['schedular'\] in the returned dict are ignored"):
        parse_optimizers({"optimizer": opt, "schedular": step_lr(opt)}, "Model")
    with pytest.warns(UserWarning, match=r"unknown keys \['every'\] in the lr_scheduler dict are ignored"):
        parse_optimizers({"optimizer": opt, "lr_scheduler": {"scheduler": step_lr(opt), "every": 2}}, "Model")


def _refusals():
    opt = sgd()
    return [
        ("adam", r"returned a str, which is not a form Lightning documents: return an optimizer"),
        ([], r"returned a list of \[\], which is not a form"),
        ([opt, "adam"], r"returned a list of \['SGD', 'str'\], which is not a form"),
        ({"lr_scheduler": step_lr(opt)}, r"returned a dict without an 'optimizer' key \(keys: \['lr_scheduler'\]\)"),
        ({"optimizer": "sgd"}, r"must give torch.optim.Optimizer objects \(got \['str'\]\)"),
        ({"optimizer": opt, "lr_scheduler": {"interval": "step"}}, r"a lr_scheduler dict needs a 'scheduler' key"),
        ({"optimizer": opt, "lr_scheduler": 0.5}, r"a float is not a learning-rate scheduler"),
        ({"optimizer": opt, "lr_scheduler": {"scheduler": step_lr(opt), "interval": "batch"}},
         r"lr_scheduler interval='batch'; use 'step' or 'epoch'"),
        ({"optimizer": opt, "lr_scheduler": {"scheduler": step_lr(opt), "frequency": 0}},
         r"lr_scheduler frequency=0; give a positive int"),
        ({"optimizer": opt, "lr_scheduler": {"scheduler": step_lr(opt), "frequency": True}},
         r"lr_scheduler frequency=True"),
        ({"optimizer": opt, "lr_scheduler": step_lr(sgd())},
         r"a scheduler \(StepLR\) is attached to an optimizer that configure_optimizers did not return"),
    ]


@pytest.mark.parametrize("index", range(len(_refusals())))
def test_every_malformed_form_is_refused_in_one_line(index):
    config, message = _refusals()[index]
    with pytest.raises(ValueError, match=r"^Model.configure_optimizers\(\)[ :].*" + message) as info:
        parse_optimizers(config, "Model")
    assert "\n" not in str(info.value)


def test_step_schedulers_by_interval_and_frequency():
    opt = sgd(1.0)
    every_step = SchedulerConfig(step_lr(opt), "step", 1)
    every_third_epoch = SchedulerConfig(step_lr(opt), "epoch", 3)
    opt.step()  # as in a fit: the optimizer steps before its schedulers
    for count in range(1, 7):
        step_schedulers([every_step, every_third_epoch], "epoch", count, {})
    assert every_step.scheduler.last_epoch == 0 and every_third_epoch.scheduler.last_epoch == 2  # counts 3 and 6
    step_schedulers([every_step, every_third_epoch], "step", 1, {})
    assert every_step.scheduler.last_epoch == 1 and every_third_epoch.scheduler.last_epoch == 2


def test_step_schedulers_hands_plateau_its_metric_or_refuses_a_missing_one():
    opt = sgd(1.0)
    plateau = SchedulerConfig(torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0), monitor="val_loss",
                              reduce_on_plateau=True)
    step_schedulers([plateau], "epoch", 1, {"val_loss": 1.0})
    step_schedulers([plateau], "epoch", 2, {"val_loss": 2.0})  # worse: the rate drops
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    with pytest.raises(KeyError, match="monitors 'val_loss', which was not logged. Logged: \\['loss'\\]. Log it, "
                                       "or set 'strict': False"):
        step_schedulers([plateau], "epoch", 3, {"loss": 1.0})
    plateau.strict = False
    with pytest.warns(UserWarning, match="The scheduler does not step"):
        step_schedulers([plateau], "epoch", 3, {"loss": 1.0})
