"""Writes that must not be lost or leaked: a save after an asynchronous fit is complete when it
returns (also in a process that exits at once); what a killed writer left is removed at the next
start even when the restarted process has the same PID (a container's PID 1)."""

import errno
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time

import conftest
import pytest
import torch
from conftest import Regressor, make_loader

from xtrainer import Trainer
from xtrainer.callbacks import Callback, ModelCheckpoint
from xtrainer.checkpoint import background, folders, load_checkpoint, storage

TESTS = os.path.dirname(os.path.abspath(conftest.__file__))
ENV = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": os.pathsep.join([TESTS, os.path.dirname(TESTS)])}


# ---- a save after an asynchronous fit ---------------------------------------------------------
SAVE_AND_EXIT = textwrap.dedent("""
    import os, sys, time
    import conftest
    from xtrainer import Trainer
    from xtrainer.callbacks import ModelCheckpoint
    from xtrainer.checkpoint import storage

    strategy, root, path = sys.argv[1:4]
    write = storage._HashingWriter.write

    def slow_write(self, data):  # a slow disk: every chunk of every checkpoint write takes 20 ms
        time.sleep(0.02)
        return write(self, data)

    storage._HashingWriter.write = slow_write
    trainer = Trainer(strategy=strategy, max_steps=4, default_root_dir=root, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, async_checkpointing=True,
                      callbacks=[ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)])
    trainer.fit(conftest.Regressor(), conftest.make_loader(64, 8))
    trainer.save_checkpoint(path)
    print("saved", os.path.exists(path), flush=True)
""")


@pytest.mark.parametrize("strategy", ["native", "xla_native"])
def test_a_save_after_an_asynchronous_fit_is_written_before_the_process_exits(tmp_path, strategy):
    path = tmp_path / "out" / "fitted.ckpt"
    done = subprocess.run([sys.executable, "-c", SAVE_AND_EXIT, strategy, str(tmp_path / "run"), str(path)],
                          capture_output=True, text=True, timeout=300, env=ENV, cwd=TESTS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "saved True" in done.stdout, done.stdout[-2000:]  # complete when save_checkpoint returned
    assert path.is_file() and not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]
    assert set(load_checkpoint(str(path))["state_dict"]) == set(Regressor().state_dict())
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"  # the fit's own, written in the background
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    assert load_checkpoint(str(checkpoints / "last.ckpt"))["loops"]["global_step"] == 4


def test_background_writes_are_on_only_while_a_stage_runs(tmp_path):
    assert not background.enabled()
    seen = []

    class Watch(ModelCheckpoint):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen.append(background.enabled())

    trainer = Trainer(max_steps=2, default_root_dir=str(tmp_path), logger=False, enable_progress_bar=False,
                      enable_model_summary=False, async_checkpointing=True, callbacks=[Watch()])
    trainer.fit(Regressor(), make_loader(32, 8))
    assert seen == [True, True] and not background.enabled()

    class Fails(ModelCheckpoint):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            raise RuntimeError("a callback fails")

    trainer = Trainer(max_steps=2, default_root_dir=str(tmp_path), logger=False, enable_progress_bar=False,
                      enable_model_summary=False, async_checkpointing=True, callbacks=[Fails()])
    with pytest.raises(RuntimeError, match="a callback fails"):
        trainer.fit(Regressor(), make_loader(32, 8))
    assert not background.enabled()  # off again after a failed stage too


def _failed_background_write() -> None:
    """A save whose background write failed (a full disk), done before the training thread goes on."""
    def full() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    background.submit(full, save=True)
    deadline = time.monotonic() + conftest.subprocess_timeout(10)
    while background.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert background.pending() == 0


@pytest.mark.parametrize("after_save", ["point_last", "remove"])
def test_what_follows_a_background_write_that_failed_is_not_done(tmp_path, after_save):
    """Chaos seed 9000, scenario 188 (xla_ddp, the disk full at step 2, async checkpointing):
    the write of step 2's checkpoint failed before the training thread came to re-point
    ``last``, so nothing was in flight and ``last.ckpt`` was pointed at a file that was never
    written. The failure is raised there instead, and ``last`` and the checkpoint before stay."""
    previous, failed = tmp_path / "epoch=0-step=1.ckpt", tmp_path / "epoch=0-step=2.ckpt"
    last = tmp_path / "last.ckpt"
    storage.write_bytes(b"complete", str(previous))
    folders.point_last(str(last), str(previous))
    _failed_background_write()
    with pytest.raises(OSError, match="No space left"):
        if after_save == "point_last":
            folders.point_last(str(last), str(failed))
        else:
            storage.remove(str(previous))  # top-k dropping the predecessor of the failed save
    assert os.path.realpath(last) == str(previous) and previous.read_bytes() == b"complete"
    assert not failed.exists()


PENDING_AT_EXIT = textwrap.dedent("""
    import os, sys, time
    from xtrainer.checkpoint import background, storage

    path = sys.argv[1]

    def write():
        time.sleep(0.5)
        storage.write_bytes(b"written", path)

    def fail():
        raise OSError("the disk went away")

    background.submit(write, save=True)  # queued, and the process ends at once
    background.submit(fail)
""")


def test_a_write_still_queued_at_exit_is_finished_and_reported():
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "late.bin")
        done = subprocess.run([sys.executable, "-c", PENDING_AT_EXIT, path], capture_output=True, text=True,
                              timeout=120, env=ENV)
        assert done.returncode == 0, done.stderr[-2000:]
        assert open(path, "rb").read() == b"written"
        assert "waiting for 2 background checkpoint write(s) still queued at exit" in done.stderr, done.stderr
        assert "a background checkpoint write failed" in done.stderr and "the disk went away" in done.stderr


# ---- what a dead writer left, when its successor has its PID ----------------------------------
def instance_of(pid, start=None, boot=None):
    """The instance name of process ``pid`` as ``writers`` writes it, its start time or boot id
    replaced where given."""
    from xtrainer.checkpoint import writers

    real_start, real_boot = writers.start_time(pid), writers._boot()
    if real_start is None or real_boot is None:
        pytest.skip("no /proc here: instances are drawn, not read")
    return f"{pid}.{real_start if start is None else start}x{real_boot if boot is None else boot}"


def test_a_dead_writer_with_this_process_pid_is_told_from_the_live_one(tmp_path):
    from xtrainer.checkpoint import writers

    host, me = socket.gethostname(), os.getpid()
    mine = instance_of(me)
    assert writers.instance() == mine
    # What a restarted container leaves: its process has the dead one's PID, started later.
    before_restart = instance_of(me, start=writers.start_time(me) - 5)
    other_boot = instance_of(me, boot="00000000" if writers._boot() != "00000000" else "11111111")
    sleeper = subprocess.Popen(["sleep", "120"])
    try:
        for _ in range(100):  # its start time is read from /proc: wait until it is sleep itself
            if open(f"/proc/{sleeper.pid}/cmdline", "rb").read().startswith(b"sleep"):
                break
            time.sleep(0.02)
        live_other = instance_of(sleeper.pid)
        reused_pid = instance_of(sleeper.pid, start=writers.start_time(sleeper.pid) + 3)
        dirpath = tmp_path / "ckpts"
        dirpath.mkdir()
        dead = [f".tmp-{host}-{before_restart}-abcd1234-epoch=0-step=3.ckpt",
                f".tmp-{host}-{other_boot}-abcd1234-epoch=0-step=4.ckpt",
                f".tmp-{host}-{reused_pid}-abcd1234-epoch=0-step=5.ckpt",
                f".tmp-{host}-{me}-abcd1234-epoch=0-step=7.ckpt"]  # an older version's name with this PID
        for name in dead:
            (dirpath / name).write_bytes(b"partial")
        staging = dirpath / f".tmp-{host}-{before_restart}-abcd1234-epoch=0-step=6.ckpt"  # a staging folder
        staging.mkdir()
        (staging / "rank-0-of-2.pt").write_bytes(b"a shard")
        dead.append(staging.name)
        complete = dirpath / f".tmp-{host}-{before_restart}-abcd1234-epoch=0-step=8.ckpt"  # killed between renames
        complete.mkdir()
        (complete / "manifest.json").write_text("{}")
        alive = [storage.temp_name("epoch=0-step=9.ckpt"),  # this process, saving now
                 f".tmp-{host}-{live_other}-abcd1234-epoch=0-step=10.ckpt",  # another run, still saving
                 f".tmp-{host}-{sleeper.pid}-abcd1234-epoch=0-step=11.ckpt",  # an older version's, still running
                 f".tmp-{host}-1-{before_restart}-abcd1234-x.ckpt",  # host {host}-1's: left alone
                 f".tmp-elsewhere-{before_restart}-abcd1234-x.ckpt"]  # another host's: left alone
        for name in alive:
            (dirpath / name).write_bytes(b"in progress")
        with pytest.warns(UserWarning, match="already holds checkpoints of another run"):  # the one put in place
            Trainer(max_steps=2, default_root_dir=str(tmp_path), logger=False, enable_progress_bar=False,
                    enable_model_summary=False, callbacks=[ModelCheckpoint(dirpath=str(dirpath))]
                    ).fit(Regressor(), make_loader(32, 8))
        left = sorted(p.name for p in dirpath.iterdir() if p.name.startswith("."))
        assert left == sorted(alive), left
        assert alive[0].startswith(f".tmp-{host}-{mine}-")  # this process names its writes by its instance
        assert sorted(p.name for p in dirpath.iterdir() if not p.name.startswith(".")) == ["epoch=0-step=2.ckpt",
                                                                                    "epoch=0-step=8.ckpt", "last.ckpt"]
        assert (dirpath / "epoch=0-step=8.ckpt" / "manifest.json").is_file()  # put in place, not removed
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_launch_folder_of_a_dead_caller_with_this_process_pid_is_removed():
    import tempfile

    from xtrainer.checkpoint import writers
    from xtrainer.strategies import launchers

    me, root = os.getpid(), tempfile.gettempdir()
    dead = [os.path.join(root, f"{launchers._LAUNCH_PREFIX}{instance_of(me, start=writers.start_time(me) - 5)}-a1b2c3"),
            os.path.join(root, f"{launchers._LAUNCH_PREFIX}{me}-d4e5f6")]  # an older version's name
    live = os.path.join(root, f"{launchers._LAUNCH_PREFIX}{writers.instance()}-g7h8i9")
    try:
        for folder in (*dead, live):
            os.mkdir(folder)
            open(os.path.join(folder, "result.pt"), "wb").close()
        launchers._remove_stale_launch_folders()
        assert [os.path.exists(folder) for folder in dead] == [False, False] and os.path.isdir(live)
    finally:
        for folder in (*dead, live):
            shutil.rmtree(folder, ignore_errors=True)


HOLD_A_LAUNCH_FOLDER = textwrap.dedent("""
    import sys, time
    from xtrainer.strategies import launchers

    with launchers.launch_folder() as folder:
        print(folder, flush=True)
        time.sleep(120)
""")


def test_a_launch_folder_of_a_live_caller_in_another_pid_namespace_is_kept():
    """A caller that runs as PID 1 of a PID namespace of its own (a container sharing /tmp, as
    the chaos harness's runs do): from here its name's PID 1 is another process (init), started
    at another time, so the name alone says dead; the lock it holds says alive, and its folder
    stays until it ends (found by the chaos harness: a job's error file vanished under it)."""
    if os.geteuid() != 0 or subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                                           capture_output=True).returncode != 0:
        pytest.skip("unshare --pid needs root")
    from xtrainer.strategies import launchers

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    holder = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, "-c",
                               HOLD_A_LAUNCH_FOLDER], stdout=subprocess.PIPE, text=True, env=env)
    try:
        folder = holder.stdout.readline().strip()
        assert os.path.basename(folder).startswith(f"{launchers._LAUNCH_PREFIX}1."), folder  # PID 1 there
        launchers._remove_stale_launch_folders()
        assert os.path.isdir(folder)
    finally:
        holder.kill()
        holder.wait()
    shutil.rmtree(folder, ignore_errors=True)  # its caller was killed: nothing removed it


def test_a_launch_folder_whose_lock_is_free_and_name_dead_is_removed(tmp_path):
    """The lock decides only where the name cannot: a folder named by this PID at another start
    time (a restarted container's predecessor) whose lock nobody holds is removed, lock file
    and all."""
    import tempfile

    from xtrainer.checkpoint import writers
    from xtrainer.strategies import launchers

    me = os.getpid()
    folder = os.path.join(tempfile.gettempdir(),
                          f"{launchers._LAUNCH_PREFIX}{instance_of(me, start=writers.start_time(me) - 7)}-j1k2l3")
    os.mkdir(folder)
    try:
        open(os.path.join(folder, launchers._OWNER_LOCK), "wb").close()
        launchers._remove_stale_launch_folders()
        assert not os.path.exists(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


PID_ONE_RUN = textwrap.dedent("""
    import json, os, sys, time
    import conftest
    from xtrainer import Trainer
    from xtrainer.callbacks import ModelCheckpoint
    from xtrainer.checkpoint import storage

    dirpath, mode = sys.argv[1:3]
    print("pid", os.getpid(), flush=True)
    if mode == "die":  # the write of step 4 stops midway, and the container is killed there
        write = storage._HashingWriter.write
        def stuck_write(self, data):
            written = write(self, data)
            if self.size > 64 and any("step=4" in name for name in os.listdir(dirpath) if name.startswith(".tmp-")):
                print("writing", json.dumps(sorted(os.listdir(dirpath))), flush=True)
                time.sleep(600)
            return written
        storage._HashingWriter.write = stuck_write
    Trainer(strategy="native", max_steps=6 if mode == "die" else 2, logger=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=os.path.dirname(dirpath),
            callbacks=[ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1)]
            ).fit(conftest.Regressor(), conftest.make_loader(64, 8))
    print("left", json.dumps(sorted(os.listdir(dirpath))), flush=True)
""")
UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]


def test_a_container_restarted_as_pid_1_removes_what_its_killed_predecessor_left(tmp_path):
    import json
    import signal

    if shutil.which("unshare") is None or subprocess.run([*UNSHARE, "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare --pid is not permitted here")
    dirpath = tmp_path / "ckpts"
    dirpath.mkdir()
    run = [*UNSHARE, sys.executable, "-c", PID_ONE_RUN, str(dirpath)]
    first = subprocess.Popen([*run, "die"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                             cwd=TESTS)
    try:
        assert first.stdout.readline().split() == ["pid", "1"]
        line = first.stdout.readline()
        assert line.startswith("writing"), line + first.stderr.read()[-3000:]
        os.kill(first.pid, signal.SIGKILL)  # unshare, and with it the container's PID 1
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    time.sleep(0.5)
    leftovers = [n for n in os.listdir(dirpath) if n.startswith(".tmp-") and n.endswith("epoch=0-step=4.ckpt")]
    host = socket.gethostname()
    assert len(leftovers) == 1 and leftovers[0].startswith(f".tmp-{host}-1"), os.listdir(dirpath)  # PID 1's
    second = subprocess.run([*run, "restart"], capture_output=True, text=True, env=ENV, cwd=TESTS, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stdout.splitlines()[0] == "pid 1"  # the same PID as the killed writer
    left = json.loads(next(line for line in second.stdout.splitlines() if line.startswith("left"))[5:])
    assert not [n for n in left if n.startswith(".tmp-")], left  # the killed write is gone
    assert "epoch=0-step=2.ckpt" in left and load_checkpoint(str(dirpath / "epoch=0-step=2.ckpt"))
    assert leftovers[0].startswith(f".tmp-{host}-1.")  # named by its instance: PID 1, started then


class PruneWhatIsResumed(Callback):
    """What a second run resuming the same lineage at the same moment does: it prunes the
    checkpoint this run resolved ``"last"`` to, between the resolution and the read (this hook
    runs in the replica, before the checkpoint is read)."""

    def setup(self, trainer, pl_module, stage):
        if trainer.ckpt_path is not None:
            os.remove(os.path.realpath(trainer.ckpt_path))


def test_a_checkpoint_pruned_between_resolving_last_and_reading_it_is_still_read(tmp_path):
    """Found by the chaos harness (two runs resumed into one root at once: one pruned the
    checkpoint the other was about to read, which then failed with "does not exist"): the
    checkpoint ``"last"`` chose is held still (hard-linked) until it has been read, and the
    resumed fit ends bitwise equal to one never stopped; the hold is gone after the read."""
    def trainer(steps, callbacks=()):
        return Trainer(max_steps=steps, default_root_dir=str(tmp_path / "runs"), enable_progress_bar=False,
                       logger=False, enable_model_summary=False,
                       callbacks=[ModelCheckpoint(every_n_train_steps=2, save_last=True), *callbacks])

    torch.manual_seed(0)
    straight = Regressor()
    Trainer(max_steps=8, default_root_dir=str(tmp_path / "straight"), enable_progress_bar=False, logger=False,
            enable_model_summary=False).fit(straight, make_loader())
    torch.manual_seed(0)
    trainer(4).fit(Regressor(), make_loader())
    resumed = Regressor()
    second = trainer(8, [PruneWhatIsResumed()])
    second.fit(resumed, make_loader(), ckpt_path="last")
    assert second.global_step == 8 and "step=4" in os.path.basename(os.path.realpath(second.ckpt_path))
    for name, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name
    assert not [p for p in (tmp_path / "runs").rglob("*") if p.name.startswith(storage.TEMP_PREFIX)]
