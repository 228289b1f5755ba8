"""Nothing outlives or piles up after a killed run, and a replica that makes the others wait too
long is named: real processes, real SIGKILL."""

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import conftest
import pytest

from conftest import subprocess_timeout

TESTS = os.path.dirname(os.path.abspath(conftest.__file__))
ENV = {**os.environ, "PJRT_DEVICE": "CPU"}


def children_of(pid):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_dataloader_workers_end_with_a_sigkilled_caller_and_ignore_ctrl_c(tmp_path):
    script = tmp_path / "fit.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {TESTS!r})
        from conftest import Regressor, make_loader
        from xtrainer import Trainer
        from xtrainer.callbacks import Callback

        class Slow(Callback):
            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                if trainer.global_step == 2:
                    print("training", flush=True)
                time.sleep(0.2)

        Trainer(max_epochs=50, enable_progress_bar=False, logger=False, enable_checkpointing=False,
                enable_model_summary=False, enable_xla_health=False, default_root_dir={str(tmp_path)!r},
                callbacks=[Slow()]).fit(
            Regressor(), make_loader(num_workers=2, persistent_workers=True))
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV, start_new_session=True)
    line = proc.stdout.readline().strip()
    if line != "training":
        proc.kill()
        pytest.fail(f"the fit did not start training: {line!r} {proc.communicate()[1][-3000:]}")
    workers = children_of(proc.pid)
    assert len(workers) >= 2
    for pid in workers:
        os.kill(pid, signal.SIGINT)  # as a terminal's Ctrl-C reaches the whole group: the workers ignore it
    time.sleep(1)
    assert all(alive(pid) for pid in workers) and proc.poll() is None
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 3
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in workers if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "DataLoader workers outlived their SIGKILLed caller by 3 s"


def test_the_private_folders_of_killed_launches_are_removed_by_the_next_one():
    from xtrainer.strategies import launchers

    from xtrainer.checkpoint import writers

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tempfile.mkdtemp(prefix=f"xtrainer-launch-{dead.pid}-")  # an older name: a bare PID, gone
    mine = tempfile.mkdtemp(prefix=f"xtrainer-launch-{writers.instance()}-")  # this process's instance
    with open(os.path.join(stale, "result.pt"), "wb") as f:
        f.write(b"weights" * 1000)
    try:
        launchers._remove_stale_launch_folders()
        assert not os.path.exists(stale)
        assert os.path.exists(mine)  # a live process's launch is left alone
    finally:
        os.rmdir(mine)


@pytest.mark.multi_device
def test_a_replica_that_keeps_the_others_waiting_too_long_is_named(tmp_path):
    script = tmp_path / "fit.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {TESTS!r})
        from conftest import Regressor, make_loader
        from xtrainer import Trainer
        from xtrainer.callbacks import Callback

        class SlowRankZero(Callback):
            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                if trainer.global_step == 2 and trainer.is_global_zero:
                    time.sleep(60)  # host work on rank 0 alone, well past XLA's wait at the next collective (5 s, then 10 s more)

        if __name__ == "__main__":
            Trainer(strategy="xla_native", devices=2, max_epochs=1, enable_progress_bar=False, logger=False,
                    enable_checkpointing=False, enable_xla_health=False, default_root_dir={str(tmp_path)!r},
                    callbacks=[SlowRankZero()]).fit(
                Regressor(), make_loader(batch_size=4))
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=ENV, timeout=subprocess_timeout(300))
    assert done.returncode != 0
    assert "waits more than 10 s at a collective" in done.stderr, done.stderr[-3000:]
