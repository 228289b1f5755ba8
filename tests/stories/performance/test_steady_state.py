"""The guarantees that make XLA training fast: stable graphs, few host syncs, one cut per step.

Counted with torch_xla's debug metrics over several epochs of a real fit with validation on.
"""

from conftest import Regressor, make_loader

from xtrainer import Trainer, _xla
from xtrainer.callbacks import Callback


class Counter(Callback):
    """Snapshots of the XLA metrics at each training epoch start."""

    def __init__(self) -> None:
        self.at_epoch_start: list[tuple[int, int, int]] = []

    def on_train_epoch_start(self, trainer, module):
        _xla.wait_device_ops()  # executions are counted when they finish: let the last one finish
        self.at_epoch_start.append(
            (_xla.compile_count(), _xla.execute_count(), _xla.transfer_from_device_count()))


def run(trainer_kwargs, epochs=5, log_every=4, **kwargs):
    _xla.clear_metrics()
    counter = Counter()

    class AdamRegressor(Regressor):
        def validation_step(self, batch, batch_idx):
            super().validation_step(batch, batch_idx)
            self.log("val_max", batch[1].max(), reduce_fx="max")

    # 40 training samples in batches of 8 (5 per epoch); 20 validation samples: 8, 8 and a last 4
    trainer = Trainer(strategy="xla_native", max_epochs=epochs, log_every_n_steps=log_every, callbacks=[counter], **kwargs,
                      **trainer_kwargs)
    trainer.fit(AdamRegressor(optimizer="adam", lr=0.01), make_loader(n=40, shuffle=True),
                make_loader(n=20, seed=1))
    return trainer, counter.at_epoch_start


def test_no_compilation_after_the_first_epoch(trainer_kwargs):
    _, snapshots = run(trainer_kwargs)
    compiles = [c for c, _, _ in snapshots]
    assert compiles[1] > 0
    assert compiles[1:] == [compiles[1]] * len(compiles[1:]), compiles


def test_one_execution_per_optimizer_step(trainer_kwargs):
    _, snapshots = run(trainer_kwargs, log_every=1000)
    per_epoch = [b[1] - a[1] for a, b in zip(snapshots, snapshots[1:])]
    # exactly: 5 training steps + 3 validation batches + the epoch-end reads (train, validation)
    assert per_epoch[1:] == [per_epoch[1]] * len(per_epoch[1:])
    assert per_epoch[1] == 5 + 3 + 2, per_epoch


def test_host_reads_only_every_log_every_n_steps(trainer_kwargs):
    _, snapshots = run(trainer_kwargs, log_every=5)
    per_epoch = [b[2] - a[2] for a, b in zip(snapshots, snapshots[1:])]
    # one read at the logging step, one at the end of training's epoch, one after validation
    assert per_epoch == [3] * len(per_epoch), per_epoch
    _, rare = run(trainer_kwargs, log_every=1000)
    assert [b[2] - a[2] for a, b in zip(rare, rare[1:])] == [2] * (len(rare) - 1)


def test_gradient_accumulation_cuts_once_per_micro_batch(trainer_kwargs):
    _, snapshots = run(trainer_kwargs, log_every=1000, accumulate_grad_batches=2, limit_val_batches=0)
    compiles = [c for c, _, _ in snapshots]
    assert compiles[1:] == [compiles[1]] * len(compiles[1:])
    per_epoch = [b[1] - a[1] for a, b in zip(snapshots, snapshots[1:])]
    assert per_epoch[1] == 5 + 1, per_epoch  # 5 micro-batches (3 steps) + the epoch-end read
