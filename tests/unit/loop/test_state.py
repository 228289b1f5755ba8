"""The loop's position (``xtrainer/loop/state.py``) and who may write it: fast, no training."""

from __future__ import annotations

import ast
import dataclasses
import os

import conftest
import pytest

from xtrainer.loop.state import LoopState

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(conftest.__file__))), "xtrainer")


def test_the_checkpoint_entry_keeps_the_documented_names():
    loop = LoopState(global_step=7, current_epoch=2, batches_in_epoch=3, epoch_finished=False, validation_pending=True,
                     epoch_schedulers_due=False, seed=11, batches_stepped=5)
    assert loop.state_dict() == {"global_step": 7, "epoch": 2, "batches_in_epoch": 3, "epoch_finished": False,
                                 "seed": 11, "validation_pending": True, "epoch_schedulers_due": False,
                                 "batches_stepped": 5}


def test_the_loggers_step_of_a_checkpoint_written_before_it_was_saved_is_its_global_step():
    old = LoopState(global_step=7, batches_stepped=5).state_dict()
    del old["batches_stepped"]
    resumed = LoopState()
    resumed.load_state_dict(old)
    assert resumed.batches_stepped == 7  # one optimizer step per batch, as such runs stepped
    resumed.load_state_dict(LoopState(global_step=7, batches_stepped=5).state_dict())
    assert resumed.batches_stepped == 5


def test_a_checkpoint_inside_an_epoch_resumes_at_its_next_unseen_batch_with_the_validation_it_owed():
    saved = LoopState(global_step=7, current_epoch=2, batches_in_epoch=3, epoch_finished=False,
                      validation_pending=True, seed=11)
    resumed = LoopState(stepped=False)
    resumed.load_state_dict(saved.state_dict())
    assert (resumed.global_step, resumed.current_epoch, resumed.skip_batches, resumed.batches_in_epoch) == (7, 2, 3, 3)
    assert resumed.validation_pending and not resumed.epoch_finished and resumed.seed == 11
    assert resumed.stepped  # a resumed run starts at an optimizer-step boundary


def test_a_checkpoint_at_an_epochs_end_resumes_at_the_next_epochs_start():
    saved = LoopState(global_step=8, current_epoch=2, batches_in_epoch=4, epoch_finished=True,
                      validation_pending=True, epoch_schedulers_due=True)
    resumed = LoopState()
    resumed.load_state_dict(saved.state_dict())
    assert (resumed.current_epoch, resumed.skip_batches, resumed.batches_in_epoch) == (3, 0, 0)
    # A validation is never owed across an epoch's end; the schedulers' step is taken by the restore.
    assert not resumed.validation_pending and not resumed.epoch_schedulers_due


def test_checkpoints_of_earlier_versions_without_the_newer_keys_load():
    resumed = LoopState(seed=5)
    resumed.load_state_dict({"global_step": 4, "epoch": 1, "batches_in_epoch": 2, "epoch_finished": False})
    assert (resumed.global_step, resumed.current_epoch, resumed.skip_batches, resumed.seed) == (4, 1, 2, 5)
    assert not resumed.validation_pending


def test_an_epochs_end_moves_to_the_next():
    loop = LoopState(current_epoch=1, batches_in_epoch=5, epoch_schedulers_due=True)
    loop.next_epoch()
    assert (loop.current_epoch, loop.batches_in_epoch, loop.epoch_schedulers_due) == (2, 0, False)


def test_the_loop_state_travels_between_processes_as_it_is():
    import pickle

    loop = LoopState(global_step=3, current_epoch=1, epoch_finished=True)
    assert pickle.loads(pickle.dumps(dataclasses.replace(loop))) == loop


def _private_writes(path: str) -> list[str]:
    """``trainer._name = ...`` (or ``+=``) in the file at ``path``."""
    found = []
    for node in ast.walk(ast.parse(open(path).read())):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if (isinstance(t, ast.Attribute) and t.attr.startswith("_") and isinstance(t.value, ast.Name)
                        and t.value.id == "trainer"):
                    found.append(f"{os.path.relpath(path, PACKAGE)}:{node.lineno}: trainer.{t.attr}")
    return found


def test_no_module_outside_the_loop_writes_the_trainers_private_state():
    writes = []
    for folder, _, files in os.walk(PACKAGE):
        if os.path.join(PACKAGE, "loop") in folder:
            continue
        writes += [w for name in files if name.endswith(".py") for w in _private_writes(os.path.join(folder, name))]
    assert writes == []


def test_the_private_write_finder_finds_them(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f(trainer):\n    trainer._results = 1\n    trainer.loop, trainer._seed = 2, 3\n"
                    "    trainer._n += 1\n    trainer.public = 4\n")
    assert [w.split(": ")[1] for w in _private_writes(str(path))] == ["trainer._results", "trainer._seed",
                                                                      "trainer._n"]


@pytest.mark.parametrize("name", ["global_step", "current_epoch"])
def test_the_trainers_position_is_read_only(name):
    from xtrainer import Trainer

    trainer = Trainer(logger=False, enable_checkpointing=False)
    trainer.loop.global_step, trainer.loop.current_epoch = 4, 2
    assert (trainer.global_step, trainer.current_epoch) == (4, 2)
    with pytest.raises(AttributeError):
        setattr(trainer, name, 0)
