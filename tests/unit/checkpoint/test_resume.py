"""``checkpoint/resume.py``: what a resume from ``"last"`` clears before it reads the lineage."""

from __future__ import annotations

import os
import socket

from conftest import Regressor, make_loader
from xtrainer import Trainer
from xtrainer.checkpoint import resume, storage, writers
from xtrainer.checkpoint.whole import WholeFile


def test_last_clears_the_dead_writers_temporaries_of_the_earlier_run_folders(tmp_path):
    """A kill while a run rewrote ``goodput.json`` (or ``config.yaml``) in its run folder leaves a
    temporary there, beside ``checkpoints/``: the next resume of the lineage removes it (a dead
    writer's: this PID, another start time), and leaves a live writer's and the user's files."""
    root = tmp_path / "runs"
    Trainer(max_steps=2, default_root_dir=str(root), enable_progress_bar=False, logger=False,
            enable_model_summary=False).fit(Regressor(), make_loader())
    run_folder = root / "version_0"
    me = os.getpid()
    dead_instance = f"{me}.{writers.start_time(me) - 3}x{writers._boot()}"
    host = socket.gethostname()
    dead = run_folder / f"{storage.TEMP_PREFIX}{host}-{dead_instance}-cc264f2b-goodput.json"
    live = run_folder / storage.temp_name("goodput.json")
    mine = run_folder / "notes.txt"
    for path in (dead, live, mine):
        path.write_text("x")
    header = resume.resolve("last", [str(run_folder / "checkpoints")], WholeFile(), "native", 1, root=str(root))
    assert header is not None and header.global_step == 2
    assert not dead.exists() and live.exists() and mine.exists()


def test_last_clears_them_also_in_a_run_folder_that_has_no_checkpoints_yet(tmp_path):
    """A run killed before its first checkpoint (its ``checkpoints/`` folder not made yet) while it
    rewrote ``goodput.json``: the temporary goes at the next resume all the same (found by the
    chaos harness: an xla_ddp run killed at step 2, its first save still in the background)."""
    root = tmp_path / "runs"
    Trainer(max_steps=2, default_root_dir=str(root), enable_progress_bar=False, logger=False,
            enable_model_summary=False).fit(Regressor(), make_loader())
    killed = root / "version_1"
    killed.mkdir()
    me = os.getpid()
    instance = f"{me}.{writers.start_time(me) - 3}x{writers._boot()}"
    dead = killed / f"{storage.TEMP_PREFIX}{socket.gethostname()}-{instance}-c70ae0cd-goodput.json"
    dead.write_text("x")
    search = resume.lineage_dirs(str(root / "version_0"))
    assert str(killed / "checkpoints") not in search
    assert resume.resolve("last", search, WholeFile(), "native", 1, root=str(root)) is not None
    assert not dead.exists()
