"""Cluster environments on their own (``xtrainer.clusters``), nothing trained: SLURM's node-list
grammar and task layouts, what a process of a SLURM job is (and an interactive shell is not), the
ranks, master and port it takes, the allocation checked against ``devices``/``num_nodes`` in one
line, torch's variables set for the strategy, the requeue signal handled as SIGTERM is, and
Lightning's import path. The real cluster is tests/stories/clusters/test_slurm.py."""

from __future__ import annotations

import os
import signal

import pytest

from xtrainer import Trainer
from xtrainer.clusters import SLURMEnvironment, expand_hostlist, prepare
from xtrainer.clusters.slurm import tasks_per_node
from xtrainer.launch import interrupts

TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def environ():
    """os.environ without SLURM's or torch's variables, as it was again afterwards."""
    saved = dict(os.environ)
    for name in list(os.environ):
        if name.startswith("SLURM_") or name in TORCH_VARS:
            del os.environ[name]
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


def srun_task(environ, rank: int = 3, local: int = 1, node: int = 1, ntasks: int = 4, layout: str = "2(x2)",
              nodes: str = "n[1-2]", job: str = "1234567", name: str = "python") -> None:
    environ.update({"SLURM_NTASKS": str(ntasks), "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local),
                    "SLURM_NODEID": str(node), "SLURM_STEP_TASKS_PER_NODE": layout, "SLURM_NODELIST": nodes,
                    "SLURM_STEP_NUM_NODES": str(len(tasks_per_node(layout))), "SLURM_JOB_ID": job,
                    "SLURM_JOB_NAME": name, "SLURM_STEP_ID": "0"})


@pytest.mark.parametrize("hostlist, hosts", [
    ("n1", ["n1"]),
    ("n[1-3,5]", ["n1", "n2", "n3", "n5"]),
    ("a1,b[01-02]", ["a1", "b01", "b02"]),
    ("gpu[098-101]-ib", ["gpu098-ib", "gpu099-ib", "gpu100-ib", "gpu101-ib"]),
    ("r[1-2]n[1,3]", ["r1n1", "r1n3", "r2n1", "r2n3"]),
    ("c[7],d", ["c7", "d"]),
])
def test_node_list_grammar(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts
    assert SLURMEnvironment.resolve_root_node_address(hostlist) == hosts[0]


@pytest.mark.parametrize("bad", ["n[1-2", "n1-2]", "n[a-b]"])
def test_node_list_errors_name_the_list(bad):
    with pytest.raises(ValueError, match="SLURM node list"):
        expand_hostlist(bad)


def test_tasks_per_node():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="cannot read"):
        tasks_per_node("2(y3)")


def test_a_task_of_a_job_and_an_interactive_shell(environ):
    assert not SLURMEnvironment.detect()
    srun_task(environ)
    assert SLURMEnvironment.detect() and SLURMEnvironment.job_id() == 1234567
    for shell in ("bash", "interactive"):
        environ["SLURM_JOB_NAME"] = shell
        assert not SLURMEnvironment.detect() and SLURMEnvironment.job_id() is None
        assert Trainer(logger=False).cluster_environment is None
        assert "RANK" not in environ  # treated as any machine: no ranks taken from the shell's job


def test_the_batch_script_itself_starts_its_own_processes(environ):
    """The batch script's process (no job step): the job's, for auto-requeue, but its ranks are not
    SLURM's (it is the one process of its job; devices=N starts the others here)."""
    srun_task(environ, rank=0, local=0, node=0, ntasks=2, layout="1(x2)")
    del environ["SLURM_STEP_ID"]
    env = prepare(None, 4, 1)
    assert isinstance(env, SLURMEnvironment) and not env.creates_processes_externally
    assert "RANK" not in environ


def test_ranks_master_and_port_become_torchs_variables(environ):
    srun_task(environ, nodes="localhost,n2")
    env = SLURMEnvironment()
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (4, 3, 1, 1)
    assert (env.local_world_size(), env.num_nodes()) == (2, 2)
    assert env.main_address == "localhost" and env.main_port == 15000 + 4567  # the job id's last four digits
    assert prepare(env, "auto", 2) is env
    assert {name: environ[name] for name in TORCH_VARS} == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "MASTER_ADDR": "localhost", "MASTER_PORT": "19567"}


def test_master_given_wins_and_torchrun_inside_the_job_keeps_its_variables(environ):
    srun_task(environ, nodes="localhost")
    environ.update(MASTER_ADDR="10.0.0.9", MASTER_PORT="23456")
    env = SLURMEnvironment()
    assert (env.main_address, env.main_port) == ("10.0.0.9", 23456)
    environ.update(RANK="0", WORLD_SIZE="8", LOCAL_RANK="0")  # torchrun's, in a task of the job
    prepare(env, "auto", 2)
    assert (environ["RANK"], environ["WORLD_SIZE"]) == ("0", "8")


def test_allocation_checked_against_devices_and_num_nodes(environ):
    srun_task(environ, rank=0, local=0, node=0)
    env = SLURMEnvironment()
    env.validate_settings("auto", 2)
    env.validate_settings(2, 2)
    with pytest.raises(ValueError) as err:
        env.validate_settings(4, 2)
    assert str(err.value) == ("Trainer(devices=4), but SLURM started 2 task(s) on each node: give devices=2 "
                              "(or 'auto'), or srun --ntasks-per-node=4.")
    with pytest.raises(ValueError, match=r"^Trainer\(num_nodes=1\), but the SLURM job step runs on 2 node\(s\): "
                                         r"give num_nodes=2, or srun --nodes=1"):
        Trainer(devices=2, num_nodes=1, logger=False)
    assert "RANK" not in environ  # refused before anything was set
    srun_task(environ, ntasks=3, layout="2,1")
    with pytest.raises(ValueError, match=r"^SLURM started 2,1 tasks per node, not the same number on every node: "
                                         r"give srun \(or #SBATCH\) --ntasks-per-node=<devices>\.$"):
        SLURMEnvironment().validate_settings("auto", 2)


def test_the_requeue_signal_asks_for_the_graceful_stop():
    """Handled as SIGTERM is, in this process and in a replicas' process it starts (which
    inherits it through the environment and installs its own graceful stop)."""
    assert interrupts.STOP_SIGNALS_VAR not in os.environ
    with interrupts.graceful(announce=False, also=(signal.SIGUSR1,)):
        assert os.environ[interrupts.STOP_SIGNALS_VAR] == str(int(signal.SIGUSR1))
        with interrupts.graceful(announce=False):  # what a started replicas' process runs
            os.kill(os.getpid(), signal.SIGUSR1)
            assert interrupts.requested() == signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    assert interrupts.STOP_SIGNALS_VAR not in os.environ


@pytest.mark.parametrize("how, said", [("kill -TERM $$", "requeued SLURM job 77"),
                                       ("exit 1", "scontrol requeue 77 failed")])
def test_an_scontrol_that_slurm_ends_while_it_requeues_the_job_counts_as_requeued(environ, tmp_path, capsys, how,
                                                                                    said):
    """SLURM ends a job's processes as it requeues the job, the ``scontrol`` that asked among them
    (seen on the real cluster: it died by SIGTERM before it could exit 0): that is the requeue
    done, not a failure to submit the job again. Another ending is one."""
    fake = tmp_path / "scontrol"  # the real one would requeue this machine's own job: the one line it runs
    fake.write_text(f"#!/bin/sh\n{how}\n")
    fake.chmod(0o755)
    environ.update({"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "PATH": f"{tmp_path}{os.pathsep}{environ['PATH']}"})
    SLURMEnvironment().stopped(signal.SIGUSR1)
    assert said in capsys.readouterr().err
