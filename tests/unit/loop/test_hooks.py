"""Trainer._call calls only the hooks that are overridden (xtrainer/loop/hooks.py)."""

import dis

import pytest
from conftest import Regressor, make_loader

from xtrainer import Trainer, XModule
from xtrainer.callbacks import Callback
from xtrainer.module import MODEL_MODE_HOOKS, MODULE_HOOKS


def _no_op(self, *args, **kwargs):
    ...


def _body(fn):
    """What a function does, by instruction (a docstring does nothing)."""
    return [(i.opname, i.argval) for i in dis.get_instructions(fn)]


@pytest.mark.parametrize("base", [Callback, XModule])
def test_every_hook_a_run_may_skip_is_a_no_op_in_its_base_class(base):
    # (the module's model-mode hooks always run: their defaults set the model's mode, as Lightning's do)
    names = [n for n in vars(base) if n.startswith("on_") and callable(vars(base)[n]) and n not in MODEL_MODE_HOOKS]
    assert len(names) > 30
    if base is XModule:
        assert set(names) == set(MODULE_HOOKS)
    for name in names:
        assert _body(vars(base)[name]) == _body(_no_op), f"{base.__name__}.{name} does something"


class Counting(Callback):
    def __init__(self):
        self.calls = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.calls["on_train_batch_end"] = self.calls.get("on_train_batch_end", 0) + 1


class Joining(Callback):
    """Adds a callback to the Trainer's list at the start of training, as some projects do."""

    def __init__(self, late):
        self.late = late

    def on_train_start(self, trainer, module):
        trainer.callbacks.append(self.late)


def test_overrides_by_class_by_instance_and_callbacks_added_during_the_fit_are_all_called(tmp_path):
    seen = []
    counting, late = Counting(), Counting()
    by_instance = Callback()
    by_instance.on_before_zero_grad = lambda trainer, module, optimizer: seen.append(("callback", trainer.global_step))
    module = Regressor()
    module.on_after_backward = lambda: seen.append(("module", None))
    trainer = Trainer(max_steps=4, default_root_dir=str(tmp_path), logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, callbacks=[counting, by_instance, Joining(late)])
    trainer.fit(module, make_loader(64, 8))
    assert counting.calls == {"on_train_batch_end": 4}
    assert late.calls == {"on_train_batch_end": 4}  # joined before the first batch
    assert seen.count(("module", None)) == 4
    assert [step for who, step in seen if who == "callback"] == [0, 1, 2, 3]


class Recording(Callback):
    """Records each batch hook it is called with, as (name, global step)."""

    def __init__(self, name, seen):
        self.name, self.seen = name, seen

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.seen.append((self.name, "start", batch_idx))

    def on_before_backward(self, trainer, module, loss):
        self.seen.append((self.name, "before_backward", trainer.global_step))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.seen.append((self.name, "end", batch_idx))


class Skipping(Regressor):
    """Lightning's meaning of -1 from on_train_batch_start: the rest of the epoch is skipped."""

    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def on_train_batch_start(self, batch, batch_idx):
        self.seen.append(("module", "start", batch_idx))
        return -1 if batch_idx == 2 else None


def test_batch_hooks_run_callbacks_then_module_in_order_and_a_callback_added_in_a_batch_joins_at_the_next(tmp_path):
    """Lightning's order: every callback's hook, then the module's (whose -1 stops the epoch)."""
    seen = []
    late = Recording("late", seen)

    class Adding(Recording):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            super().on_train_batch_start(trainer, module, batch, batch_idx)
            if batch_idx == 0:
                trainer.callbacks.append(late)

    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, callbacks=[Adding("a", seen), Recording("b", seen)])
    trainer.fit(Skipping(seen), make_loader(64, 8))
    assert trainer.global_step == 2  # batch 2's start said -1: batches 2 to 7 skipped
    assert seen == [
        ("a", "start", 0), ("b", "start", 0), ("module", "start", 0),
        ("a", "before_backward", 0), ("b", "before_backward", 0), ("a", "end", 0), ("b", "end", 0),
        ("a", "start", 1), ("b", "start", 1), ("late", "start", 1), ("module", "start", 1),
        ("a", "before_backward", 1), ("b", "before_backward", 1), ("late", "before_backward", 1),
        ("a", "end", 1), ("b", "end", 1), ("late", "end", 1),
        ("a", "start", 2), ("b", "start", 2), ("late", "start", 2), ("module", "start", 2),
    ]


def test_a_callback_replaced_or_removed_in_place_during_the_fit_is_seen_from_the_next_batch(tmp_path):
    """``trainer.callbacks[i] = other``, or a callback removed and another appended in one batch,
    keep the list and its length: the callbacks taken out are not called again, those put in are."""
    seen = []
    old, new, gone = Recording("old", seen), Recording("new", seen), Recording("gone", seen)

    class Swapping(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 0:
                trainer.callbacks[trainer.callbacks.index(old)] = new
            if batch_idx == 1:
                trainer.callbacks.remove(gone)
                trainer.callbacks.append(Recording("late", seen))

    trainer = Trainer(max_steps=3, default_root_dir=str(tmp_path), logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, callbacks=[old, gone, Swapping()])
    trainer.fit(Regressor(), make_loader(64, 8))
    starts = [(name, batch) for name, hook, batch in seen if hook == "start"]
    assert starts == [("old", 0), ("gone", 0), ("new", 1), ("gone", 1), ("new", 2), ("late", 2)]
