"""A real SLURM cluster on localhost for the tests: one ``slurmctld`` and two ``slurmd`` (nodes
``n1`` and ``n2``, both 127.0.0.1), with ``munged`` started by hand with its own key and socket,
everything under a temporary folder and on free ports (no systemd, nothing of the host's own
configuration used). The Debian packages (``slurmctld slurmd slurm-client munge``, SLURM 22.05)
are installed when missing (as root, about 15 s; without root the tests that need them skip).

``Cluster.env`` is the environment a test runs ``srun``/``sbatch``/``scontrol`` under
(``SLURM_CONF`` names the cluster's configuration); the commands inherit it, and so do the jobs
(``sbatch`` exports the caller's environment)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
DAEMONS = ("/usr/sbin/munged", "/usr/sbin/mungekey", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")
NODES = ("n1", "n2")
CPUS_PER_NODE = 4  # declared (config_overrides): two tasks per node and room for a second job step


class Unavailable(RuntimeError):
    """SLURM cannot be installed or started on this machine (the tests skip with this reason)."""


def ensure_packages() -> None:
    """Debian's SLURM and munge, installed if missing (``apt-get``, as root)."""
    if all(os.path.exists(path) for path in DAEMONS) and shutil.which("srun"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise Unavailable("SLURM is not installed and this is not a Debian machine run as root: "
                          f"apt-get install {' '.join(PACKAGES)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", *PACKAGES]
    if subprocess.run(install, env=env, capture_output=True, timeout=600).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
        done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise Unavailable(f"apt-get install {' '.join(PACKAGES)} failed: {done.stderr.strip()[-300:]}")


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (consecutive where ``Port=[a-b]`` needs it: the
    nodes' are drawn as a run of two)."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port not in ports:
            ports.append(port)
    return ports


def _free_run(n: int) -> int:
    """The first of ``n`` consecutive free ports."""
    for _ in range(200):
        start = _free_ports(1)[0]
        if start + n > 65535:
            continue
        try:
            with contextlib.ExitStack() as stack:
                for port in range(start, start + n):
                    probe = stack.enter_context(socket.socket())
                    probe.bind(("127.0.0.1", port))
            return start
        except OSError:
            continue
    raise Unavailable(f"no {n} consecutive free ports on 127.0.0.1")


class Cluster:
    """The running cluster: its folder, its environment, and helpers to wait on jobs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[subprocess.Popen] = []
        self.env: dict[str, str] = {}

    # ---- up and down --------------------------------------------------------------------
    def start(self) -> None:
        root = self.root
        for name in ("state", "munge", "log", "run"):
            (root / name).mkdir(parents=True, exist_ok=True)
        os.chmod(root / "munge", 0o700)
        key, sock = root / "munge" / "munge.key", root / "munge" / "munge.socket"
        subprocess.run(["/usr/sbin/mungekey", "-c", "-k", str(key)], check=True, capture_output=True)
        os.chmod(key, 0o600)
        self.procs.append(subprocess.Popen(
            ["/usr/sbin/munged", "-F", "--force", f"--key-file={key}", f"--socket={sock}",
             f"--pid-file={root / 'munge' / 'munged.pid'}", f"--log-file={root / 'log' / 'munged.log'}",
             f"--seed-file={root / 'munge' / 'munged.seed'}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        self._wait_for(lambda: sock.exists(), "munged's socket", 10)
        ctld_port = _free_ports(1)[0]
        node_port = _free_run(len(NODES))
        conf = root / "slurm.conf"
        host = socket.gethostname()
        conf.write_text("\n".join([
            "ClusterName=xtrainer-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={sock}",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'run'}/spool-%n",
            f"SlurmctldPidFile={root / 'run'}/slurmctld.pid",
            f"SlurmdPidFile={root / 'run'}/slurmd-%n.pid",
            f"SlurmctldLogFile={root / 'log'}/slurmctld.log",
            f"SlurmdLogFile={root / 'log'}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny",
            "SlurmdParameters=config_overrides",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin", "MpiDefault=none", "SwitchType=switch/none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none", "MailProg=/bin/true", "ReturnToService=2",
            "KillWait=30", "InactiveLimit=0", "MinJobAge=600", "SlurmdTimeout=300",
            "JobRequeue=1",
            f"NodeName=n[1-{len(NODES)}] NodeAddr=127.0.0.1 Port=[{node_port}-{node_port + len(NODES) - 1}] "
            f"CPUs={CPUS_PER_NODE} State=UNKNOWN",
            "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))
        self.env = {**os.environ, "SLURM_CONF": str(conf)}
        for name in [key for key in self.env if key.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            if name != "SLURM_CONF":
                del self.env[name]
        log = open(root / "log" / "daemons.out", "ab")
        self.procs.append(subprocess.Popen(["/usr/sbin/slurmctld", "-D", "-i", "-f", str(conf)], env=self.env,
                                           stdout=log, stderr=log, start_new_session=True))
        for node in NODES:
            self.procs.append(subprocess.Popen(["/usr/sbin/slurmd", "-D", "-N", node, "-f", str(conf)], env=self.env,
                                               stdout=log, stderr=log, start_new_session=True))
        self._wait_for(self._nodes_idle, "both nodes idle (sinfo)", 30)

    def stop(self) -> None:
        """Every job cancelled, then the daemons ended (their process groups: a job step's
        processes too)."""
        if self.env:
            subprocess.run(["scancel", "--user=root"], env=self.env, capture_output=True, timeout=30)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and self.squeue():
                time.sleep(0.2)
        for proc in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self.procs.clear()

    def _nodes_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(node) == "idle" for node in NODES)

    def _wait_for(self, ready, what: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not ready():
            if any(proc.poll() is not None for proc in self.procs):
                raise Unavailable(f"a SLURM daemon ended while waiting for {what}: {self.logs()}")
            if time.monotonic() > deadline:
                raise Unavailable(f"waited {seconds} s for {what}: {self.logs()}")
            time.sleep(0.1)

    def logs(self) -> str:
        """The daemons' last log lines (for a failure's message)."""
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            lines = path.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    # ---- commands and jobs ----------------------------------------------------------------
    def run(self, argv: list[str], check: bool = True, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        done = subprocess.run(argv, env=kwargs.pop("env", self.env), capture_output=True, text=True,
                              timeout=timeout, **kwargs)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited with {done.returncode}: {done.stderr.strip()}")
        return done

    def squeue(self) -> list[str]:
        return self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (``JobState``, ``Restarts``, ``ExitCode``...)."""
        out = self.run(["scontrol", "-o", "show", "job", job_id], check=False).stdout
        fields: dict[str, str] = {}
        for item in out.split():
            name, _, value = item.partition("=")
            fields.setdefault(name, value)
        return fields

    def sbatch(self, script: str, *args: str, cwd: Path | None = None) -> str:
        """Submit ``script`` (its text); the job's id."""
        path = Path(cwd or self.root) / f"job-{time.monotonic_ns()}.sh"
        path.write_text(script)
        done = self.run(["sbatch", "--parsable", *args, str(path)], cwd=cwd or self.root)
        return done.stdout.strip().split(";")[0]

    def wait_state(self, job_id: str, states: tuple[str, ...], seconds: float) -> dict[str, str]:
        """Until the job is in one of ``states``; its fields then."""
        deadline = time.monotonic() + seconds
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} is {info.get('JobState')} after {seconds} s, not one of "
                                     f"{states}: {info}\n{self.logs()}")
            time.sleep(0.2)


@contextlib.contextmanager
def cluster(root: Path) -> Iterator[Cluster]:
    """A running cluster under ``root``, ended (jobs and daemons) on leaving."""
    ensure_packages()
    running = Cluster(root)
    try:
        running.start()
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> Iterator[Cluster]:
    """The session's cluster (its tests import this fixture); skips where SLURM cannot be had."""
    try:
        ensure_packages()
    except Unavailable as err:
        pytest.skip(str(err))
    with cluster(tmp_path_factory.mktemp("slurm")) as running:
        yield running
