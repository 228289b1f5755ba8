"""``strategies/launchers/__init__.py``: what a launch says of a replica's process that a signal ended."""

from __future__ import annotations

import signal

from xtrainer.strategies.launchers import _killed_error


def test_a_replica_ended_by_a_signal_is_named_with_the_likely_cause():
    """SIGKILL: from outside (the out-of-memory killer first); SIGSEGV and its kind: a crash in
    native code; any other signal nothing handles (SIGUSR1, a scheduler's notice): from outside,
    not a crash (found by the chaos harness, which reported a SIGUSR1 as a crash)."""
    killed = str(_killed_error(1, signal.SIGKILL, False))
    assert killed.startswith("Rank 1's process was ended by SIGKILL (signal 9)") and "out-of-memory" in killed
    assert "a crash in native code" in str(_killed_error(2, signal.SIGSEGV, True))
    notice = str(_killed_error(1, signal.SIGUSR1, False))
    assert "SIGUSR1 came from outside the process" in notice and "crash" not in notice
    assert "resume with fit(..., ckpt_path='last')" in notice


def test_the_replica_is_named_by_its_rank_as_every_other_error_names_it():
    """The rank, in the word torch and the other errors use ("after rank 0 had finished", torchrun's
    "[rank2]"), so that a search of the log for "rank 2" finds the cause (chaos seed 10000 #181:
    SIGUSR1 to rank 2 of 4 said "Replica 2", and the harness's check for "rank 2" failed)."""
    for signum in (signal.SIGUSR1, signal.SIGKILL, signal.SIGSEGV):
        assert str(_killed_error(2, signum, False)).lower().startswith("rank 2's process was ended by")
