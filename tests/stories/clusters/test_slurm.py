"""SLURM jobs against a real cluster on this machine (``slurm_cluster.py``: slurmctld, two slurmd
nodes ``n1``/``n2`` on 127.0.0.1, munged): ``srun`` tasks running ``native_ddp`` in place over gloo,
a job that requeues itself on its signal and resumes bitwise, ``scancel`` mid-run, a node's tasks
killed, and an allocation that does not match ``devices``/``num_nodes``. Each fit is
``slurm_run.py`` (``ExactNet``: its sums exact, so a resumed run is bitwise equal to one never
stopped), compared with the same fit of as many local processes (``Trainer(devices=N)``)."""

from __future__ import annotations

import glob
import os
import re
import signal
import sys
import time
from pathlib import Path

import conftest
import pytest
import torch

import native_run
from conftest import subprocess_timeout
from slurm_cluster import Cluster, slurm  # noqa: F401  (the session's cluster fixture)
from xtrainer.checkpoint.storage import TEMP_PREFIX, verify_zip

pytestmark = pytest.mark.cluster

HERE = Path(conftest.__file__).parent
STEPS = 16


def job_env(cluster: Cluster) -> dict[str, str]:
    """The jobs' environment: the cluster's, one intra-op thread per task (four tasks share two
    cores), this checkout importable."""
    env = dict(cluster.env, OMP_NUM_THREADS="1", PYTHONPATH=f"{HERE}{os.pathsep}{HERE.parent}", PYTHONUNBUFFERED="1")
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    return env


def batch_script(root: Path, *run_args: str, steps: int = STEPS) -> str:
    """A two-node job of four tasks running ``slurm_run.py`` (its output appended to
    ``root/job.out`` across requeues)."""
    return "\n".join([
        "#!/bin/bash",
        "#SBATCH --nodes=2 --ntasks-per-node=2 --requeue --open-mode=append",
        f"#SBATCH --output={root}/job.out",
        f"srun {sys.executable} {HERE / 'slurm_run.py'} --root {root} --out {root}/out.pt --steps {steps} "
        + " ".join(run_args),
        "",
    ])


def wait_for_file(path: Path, seconds: float, cluster: Cluster, job: str) -> None:
    deadline = time.monotonic() + subprocess_timeout(seconds)
    while not path.exists():
        state = cluster.job(job).get("JobState")
        if state not in ("PENDING", "RUNNING", "CONFIGURING"):
            raise AssertionError(f"job {job} is {state} before {path.name} appeared:\n{read(path.parent / 'job.out')}")
        assert time.monotonic() < deadline, f"{path} not written: {cluster.job(job)}"
        time.sleep(0.1)


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def processes_of(root: Path) -> list[int]:
    """The live processes whose command line names ``root`` (a job's tasks)."""
    found = []
    for entry in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(entry, "rb") as f:
                if str(root).encode() in f.read():
                    found.append(int(entry.split("/")[2]))
        except OSError:
            pass
    return [pid for pid in found if pid != os.getpid()]


def assert_left_clean(root: Path, seconds: float = 20) -> None:
    """No task of the job alive, no temporary file, every checkpoint whole."""
    deadline = time.monotonic() + seconds
    while processes_of(root) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_of(root), f"processes left: {processes_of(root)}"
    temps = [p for p in root.rglob("*") if p.name.startswith(TEMP_PREFIX)]
    assert not temps, temps
    ckpts = [p for p in root.rglob("*.ckpt") if p.is_file()]
    for ckpt in ckpts:
        verify_zip(str(ckpt))
    assert ckpts


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The weights of the fit on 4 local processes (``Trainer(devices=4)``)."""
    root = tmp_path_factory.mktemp("local4")
    _, model = native_run.fit("native_ddp", 4, str(root), STEPS, 8)
    return native_run.whole_weights(model)


@pytest.fixture(scope="module")
def reference2(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The weights of the fit on 2 local processes (the sums of 16 steps are exact at one world
    size, not across world sizes)."""
    root = tmp_path_factory.mktemp("local2")
    _, model = native_run.fit("native_ddp", 2, str(root), STEPS, 8)
    return native_run.whole_weights(model)


def assert_equal_weights(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert found.keys() == expected.keys()
    for name in expected:
        assert torch.equal(found[name], expected[name]), name


def test_srun_two_nodes_four_tasks_equal_four_local_processes(slurm, tmp_path, reference):
    """``srun -N 2 -n 4``: ranks, nodes and the master from SLURM's variables (the first node's
    name, ``n1``, is no host name here: its NodeAddr), one run folder, rank 0's weights equal to
    the 4 local processes' bitwise."""
    root = tmp_path / "run"
    root.mkdir()
    done = slurm.run(["srun", "-N", "2", "-n", "4", "--ntasks-per-node=2", sys.executable, str(HERE / "slurm_run.py"),
                      "--root", str(root), "--out", str(root / "out.pt"), "--steps", str(STEPS), "--num-nodes", "2"],
                     check=False, timeout=subprocess_timeout(60), env=job_env(slurm), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = torch.load(root / "out.pt", weights_only=False)
    assert (out["world_size"], out["global_step"]) == (4, STEPS)
    assert_equal_weights(out["weights"], reference)
    assert [p.name for p in root.iterdir() if p.name.startswith("version_")] == ["version_0"]


def test_allocation_that_does_not_match_is_refused(slurm, tmp_path):
    """One task per node with devices=2, and two nodes with num_nodes=1: a one-line error saying
    what to change, before any process group."""
    def refused(layout: list[str], *extra: str) -> str:
        done = slurm.run(["srun", *layout, sys.executable, str(HERE / "slurm_run.py"), "--root", str(tmp_path),
                          "--out", str(tmp_path / "out.pt"), *extra],
                         check=False, timeout=subprocess_timeout(40), env=job_env(slurm), cwd=tmp_path)
        assert done.returncode != 0
        lines = [line for line in done.stderr.splitlines() if line.startswith("refused: ")]
        assert lines, done.stderr[-2000:]
        return lines[0]

    assert refused(["-N", "1", "-n", "1"], "--devices", "2", "--num-nodes", "1") == (
        "refused: Trainer(devices=2), but SLURM started 1 task(s) on each node: give devices=1 (or 'auto'), or "
        "srun --ntasks-per-node=2.")
    assert refused(["-N", "2", "-n", "2"], "--devices", "1", "--num-nodes", "1") == (
        "refused: Trainer(num_nodes=1), but the SLURM job step runs on 2 node(s): give num_nodes=2, or srun "
        "--nodes=1 (#SBATCH --nodes=1).")
    assert not list(tmp_path.glob("version_*"))


def test_signalled_job_requeues_itself_and_resumes_bitwise(slurm, tmp_path, reference):
    """USR1 to the job's tasks (what ``#SBATCH --signal=USR1@90`` sends before the time limit):
    every rank stops at one step and the checkpoint is written, rank 0 requeues the job, and the
    requeued job (SLURM_RESTART_COUNT=1) resumes from last on its own, ending with the weights of
    the run never stopped."""
    root = tmp_path / "run"
    root.mkdir()
    job = slurm.sbatch(batch_script(root, "--pause", "0.3", "--ready", str(root / "READY")), cwd=tmp_path)
    wait_for_file(root / "READY", 60, slurm, job)
    slurm.run(["scancel", "--signal=USR1", job])  # the tasks of the job's steps, not the batch shell
    info = slurm.wait_state(job, ("PENDING",), subprocess_timeout(30))
    assert info["Restarts"] == "1", info
    time.sleep(2.5)  # released sooner than PENDING + ~2 s, the job fails ("Job credential revoked")
    slurm.run(["scontrol", "update", f"jobid={job}", "StartTime=now"])
    info = slurm.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), subprocess_timeout(60))
    log = read(root / "job.out")
    assert info["JobState"] == "COMPLETED", log[-3000:]
    assert log.count("requeued SLURM job") == 1, log[-3000:]
    stopped = re.findall(r"rank (\d): Stopped by SIGUSR1 at step (\d+)", log)
    assert sorted(rank for rank, _ in stopped) == ["0", "1", "2", "3"], log[-3000:]
    assert len({step for _, step in stopped}) == 1 and 3 <= int(stopped[0][1]) < STEPS, stopped
    out = torch.load(root / "out.pt", weights_only=False)
    assert out["restarts"] == 1 and out["resumed_from"] and out["global_step"] == STEPS
    assert_equal_weights(out["weights"], reference)


def test_the_batch_script_itself_requeues_on_the_signal_it_passes_on(slurm, tmp_path, reference2):
    """``python`` run by the batch script without ``srun`` (one task, ``devices=2``: it starts its
    second process itself), signalled as ``--signal=B:USR1`` does (the batch shell only, whose
    trap passes it on): both processes stop at one step, the job requeues itself, and resumes
    from last to the weights of the run never stopped."""
    root = tmp_path / "run"
    root.mkdir()
    job = slurm.sbatch("\n".join([
        "#!/bin/bash",
        "#SBATCH --nodes=1 --ntasks=1 --requeue --open-mode=append",
        f"#SBATCH --output={root}/job.out",
        f"{sys.executable} {HERE / 'slurm_run.py'} --root {root} --out {root}/out.pt --steps {STEPS} --devices 2 "
        f"--pause 0.3 --ready {root}/READY &",
        "pid=$!",
        "trap 'kill -USR1 $pid' USR1",
        "wait $pid",
        "wait $pid",
        "",
    ]), cwd=tmp_path)
    wait_for_file(root / "READY", 60, slurm, job)
    slurm.run(["scancel", "--signal=USR1", "--batch", job])  # what --signal=B:USR1@N sends
    slurm.wait_state(job, ("PENDING",), subprocess_timeout(30))
    time.sleep(2.5)
    slurm.run(["scontrol", "update", f"jobid={job}", "StartTime=now"])
    info = slurm.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), subprocess_timeout(60))
    log = read(root / "job.out")
    assert info["JobState"] == "COMPLETED" and log.count("requeued SLURM job") == 1, log[-3000:]
    assert re.search(r"rank 0: Stopped by SIGUSR1 at step \d+", log), log[-3000:]
    out = torch.load(root / "out.pt", weights_only=False)
    assert (out["restarts"], out["world_size"], out["global_step"]) == (1, 2, STEPS)
    assert_equal_weights(out["weights"], reference2)


def test_signal_during_validate_requeues_and_the_job_validates_again(slurm, tmp_path):
    """USR1 to the tasks of a job running ``trainer.validate`` (not a fit): the tasks end the
    stage with the one line (nothing to save), rank 0 requeues the job once, and the requeued job
    validates to the end, with the loss of the whole validation set (Lightning's SLURM handler
    requeues in every stage; without it the signal's default action ends the task unannounced)."""
    root = tmp_path / "run"
    root.mkdir()
    job = slurm.sbatch(batch_script(root, "--stage", "validate", "--pause", "0.3", "--ready", str(root / "READY")),
                       cwd=tmp_path)
    wait_for_file(root / "READY", 60, slurm, job)
    slurm.run(["scancel", "--signal=USR1", job])
    info = slurm.wait_state(job, ("PENDING",), subprocess_timeout(30))
    assert info["Restarts"] == "1", info
    time.sleep(2.5)
    slurm.run(["scontrol", "update", f"jobid={job}", "StartTime=now"])
    info = slurm.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), subprocess_timeout(60))
    log = read(root / "job.out")
    assert info["JobState"] == "COMPLETED" and log.count("requeued SLURM job") == 1, log[-3000:]
    # rank 0 ends the stage and requeues at once (nothing to save): SLURM then ends the tasks
    # that have not ended theirs yet, so only rank 0's line is sure to be there
    stopped = re.findall(r"rank (\d): Stopped by SIGUSR1 during validate: nothing to save", log)
    assert "0" in stopped and "Traceback" not in log, log[-3000:]
    out = torch.load(root / "out.pt", weights_only=False)
    x, y = native_run.make_data().tensors
    with torch.no_grad():
        expected = ((native_run.ExactNet()(x) - y) ** 2).mean().item()
    assert out["restarts"] == 1 and abs(out["val_loss"] - expected) <= 1e-6 * abs(expected), (out, expected)


def test_scancel_mid_run_stops_cleanly(slurm, tmp_path):
    """``scancel``: SIGTERM to every task, the agreed stop at one step and its checkpoint, every
    task ending by itself within KillWait (30 s, SLURM's default, before its SIGKILL), the job
    cancelled, no process left, nothing half-written."""
    root = tmp_path / "run"
    root.mkdir()
    job = slurm.sbatch(batch_script(root, "--pause", "0.5", "--ready", str(root / "READY"), steps=40), cwd=tmp_path)
    wait_for_file(root / "READY", 60, slurm, job)
    slurm.run(["scancel", job])
    info = slurm.wait_state(job, ("CANCELLED", "COMPLETED", "FAILED"), subprocess_timeout(30))
    assert info["JobState"] == "CANCELLED", info
    assert_left_clean(root)
    log = read(root / "job.out")
    stopped = re.findall(r"rank (\d): Stopped by SIGTERM at step (\d+)", log)
    assert sorted(rank for rank, _ in stopped) == ["0", "1", "2", "3"], log[-3000:]
    assert len({step for _, step in stopped}) == 1, stopped
    assert "Killed" not in log and "requeued" not in log, log[-3000:]  # each task ended by itself, before KillWait


def test_a_node_whose_tasks_are_killed_fails_the_job(slurm, tmp_path):
    """Node ``n2``'s two tasks killed (SIGKILL) mid-run: the others fail on the lost connection
    instead of waiting out the collective's timeout, the job ends FAILED, no process is left,
    and the checkpoints written before are whole."""
    root = tmp_path / "run"
    root.mkdir()
    job = slurm.sbatch(batch_script(root, "--pause", "0.5", "--ready", str(root / "READY"), steps=40), cwd=tmp_path)
    for rank in range(4):
        wait_for_file(root / f"READY-{rank}", 60, slurm, job)
    for rank in (2, 3):  # SLURM_NODEID 1: n2 (block distribution, two per node)
        os.kill(int(read(root / f"READY-{rank}")), signal.SIGKILL)
    info = slurm.wait_state(job, ("FAILED", "CANCELLED", "COMPLETED"), subprocess_timeout(40))
    assert info["JobState"] == "FAILED", info
    assert_left_clean(root)
