"""The callback contract."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from lightning_utilities.core.rank_zero import rank_zero_warn

from xtrainer.suggest import did_you_mean
from xtrainer.trainer_view import TrainerView

if TYPE_CHECKING:
    from xtrainer.module import XModule


class Callback:
    """Base class of callbacks: every hook is a no-op; override the ones you need.

    ``Trainer.fit`` calls the hooks in this order (each callback's, in the order given to the
    Trainer, then the module's hook of the same name, as in Lightning; at an epoch's end the
    module's first, so that callbacks see what it logs. The documentation's "The training loop"
    page shows the same block, and a test keeps the two equal)::

        on_fit_start
        sanity check: validation loop on num_sanity_val_steps batches   # on_sanity_check_start/end around it
        on_train_start
        while not (max_epochs or max_steps reached or trainer.should_stop):
            on_train_epoch_start
            for batch_idx, batch in train_loader:                 # XLA: already on the device
                the batch-transfer hooks of the module or data module  # where overridden (not callbacks)
                on_train_batch_start
                loss = training_step(batch, batch_idx) / accumulate_grad_batches
                if this micro-batch starts a window:              # every accumulate_grad_batches
                    on_before_zero_grad; zero_grad                # the last step's gradients go
                on_before_backward; loss.backward(); on_after_backward
                if this micro-batch steps the optimizer:          # every accumulate_grad_batches
                    reduce gradients (across replicas)
                    on_before_optimizer_step; clip (gradient_clip_val); optimizer.step()
                    schedulers with interval="step"
                runtime.sync()                                    # GRAPH CUT on XLA: one execution
                every log_every_n_steps steps: read logged values # HOST SYNC (one transfer)
                on_train_batch_end
                if val_check_interval hits: validation loop
            read epoch values (module's on_train_epoch_end first) # HOST SYNC (one transfer)
            on_train_epoch_end                                    # ModelCheckpoint saves here
            schedulers with interval="epoch"
        on_train_end; on_fit_end                                  # then the last step's gradients are dropped
        on_exception(exception)                                   # instead, when the run ends with an error or a signal

        validation loop: on_validation_start; on_validation_epoch_start
            for each batch: the batch-transfer hooks; on_validation_batch_start; validation_step; runtime.sync(); on_validation_batch_end
            read epoch values                                     # HOST SYNC (one transfer)
            on_validation_epoch_end; on_validation_end

    ``validate``/``test``/``predict`` run the evaluation loop alone, with their own names.
    A callback stops training by setting ``trainer.should_stop = True``. A callback with state
    returns it from ``state_dict`` so that resuming from a checkpoint restores it.

    Only the hooks a callback overrides (in its class, or set on the instance before the run)
    are called: the Trainer looks them up when a hook is first called in a run, and again when
    ``trainer.callbacks`` changes (``xtrainer/loop/hooks.py``).
    """

    @property
    def state_key(self) -> str:
        """The key of this callback's state in a checkpoint (unique per class by default)."""
        return type(self).__qualname__

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        del state_dict

    def setup(self, trainer: "TrainerView", module: "XModule", stage: str) -> None: ...
    def teardown(self, trainer: "TrainerView", module: "XModule", stage: str) -> None: ...
    def on_fit_start(self, trainer: "TrainerView", module: "XModule") -> None: ...
    def on_fit_end(self, trainer: "TrainerView", module: "XModule") -> None: ...
    def on_train_start(self, trainer: "TrainerView", module: "XModule") -> None: ...
    def on_train_end(self, trainer: "TrainerView", module: "XModule") -> None: ...
    def on_train_epoch_start(self, trainer: "TrainerView", module: "XModule") -> None: ...
    def on_train_epoch_end(self, trainer: "TrainerView", module: "XModule") -> None: ...
    def on_train_batch_start(self, trainer: "TrainerView", module: "XModule", batch: Any, batch_idx: int) -> None: ...
    def on_train_batch_end(self, trainer: "TrainerView", module: "XModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None: ...
    def on_validation_start(self, trainer: "TrainerView", module: "XModule") -> None: ...
    def on_validation_end(self, trainer: "TrainerView", module: "XModule") -> None: ...
    def on_validation_epoch_start(self, trainer: "TrainerView", module: "XModule") -> None: ...
    def on_validation_epoch_end(self, trainer: "TrainerView", module: "XModule") -> None: ...
    def on_validation_batch_start(self, trainer: "TrainerView", module: "XModule", batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None: ...
    def on_validation_batch_end(self, trainer: "TrainerView", module: "XModule", outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_start(self, trainer: "TrainerView", module: "XModule") -> None: ...
    def on_test_end(self, trainer: "TrainerView", module: "XModule") -> None: ...
    def on_test_epoch_start(self, trainer: "TrainerView", module: "XModule") -> None: ...
    def on_test_epoch_end(self, trainer: "TrainerView", module: "XModule") -> None: ...
    def on_test_batch_start(self, trainer: "TrainerView", module: "XModule", batch: Any, batch_idx: int,
                            dataloader_idx: int = 0) -> None: ...
    def on_test_batch_end(self, trainer: "TrainerView", module: "XModule", outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_start(self, trainer: "TrainerView", module: "XModule") -> None: ...
    def on_predict_end(self, trainer: "TrainerView", module: "XModule") -> None: ...
    def on_predict_epoch_start(self, trainer: "TrainerView", module: "XModule") -> None: ...
    def on_predict_epoch_end(self, trainer: "TrainerView", module: "XModule") -> None: ...
    def on_predict_batch_start(self, trainer: "TrainerView", module: "XModule", batch: Any, batch_idx: int,
                               dataloader_idx: int = 0) -> None: ...
    def on_predict_batch_end(self, trainer: "TrainerView", module: "XModule", outputs: Any, batch: Any,
                             batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_before_backward(self, trainer: "TrainerView", module: "XModule", loss: Any) -> None: ...
    def on_after_backward(self, trainer: "TrainerView", module: "XModule") -> None: ...
    def on_before_optimizer_step(self, trainer: "TrainerView", module: "XModule", optimizer: Any) -> None: ...
    def on_before_zero_grad(self, trainer: "TrainerView", module: "XModule", optimizer: Any) -> None: ...
    def on_save_checkpoint(self, trainer: "TrainerView", module: "XModule", checkpoint: dict[str, Any]) -> None: ...
    def on_load_checkpoint(self, trainer: "TrainerView", module: "XModule", checkpoint: dict[str, Any]) -> None: ...
    def on_sanity_check_start(self, trainer: "TrainerView", module: "XModule") -> None: ...
    def on_sanity_check_end(self, trainer: "TrainerView", module: "XModule") -> None: ...
    def on_exception(self, trainer: "TrainerView", module: "XModule", exception: BaseException) -> None:
        """A run is ending with ``exception``: a replica's error, or ``TrainingInterrupted`` on
        SIGTERM/SIGINT, in which case a checkpoint is written right after this hook (so state a
        callback changes here is saved with it)."""

    def on_metrics(self, trainer: "TrainerView", module: "XModule", metrics: dict[str, float], step: int) -> None:
        """Logged values just read back to the host (floats), every ``log_every_n_steps``
        steps and at the end of each epoch. Loggers and progress bars listen here."""


CALLBACK_HOOKS = frozenset(name for name in vars(Callback) if name.startswith("on_")) | {"setup", "teardown"}


def check_hook_names(obj: Any, known: Iterable[str], base: type) -> None:
    """Warn (on rank 0) of a method named like a hook that is not one
    (``on_train_epoch_ned``...): it is never called. The run goes on, as in Lightning."""
    known = set(known)
    for klass in type(obj).__mro__:
        if klass is base or klass is object:
            break
        for name, value in vars(klass).items():
            if name.startswith("on_") and callable(value) and name not in known:
                hint = did_you_mean(name, sorted(known))
                rank_zero_warn(
                    f"{klass.__name__}.{name} looks like a hook but there is no hook of that name, "
                    f"so it is never called.{hint} Rename it, or drop the 'on_' prefix if it is a "
                    "helper."
                )
