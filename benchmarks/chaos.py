"""The chaos harness: seeded random faults drawn from a matrix, each followed by a resume, with
invariants checked after every run.

    python benchmarks/chaos.py --soak 200 [--seed 0]     # 200 random scenarios, a table at the end
    python benchmarks/chaos.py --quick                   # the fixed set CI runs (tests/stories/signals/test_chaos.py)
    python benchmarks/chaos.py --seed N --only K         # replay scenario K of seed N
    python benchmarks/chaos.py --quick --only K          # one scenario of the fixed set

A scenario is a tiny fit (``tests/chaos_run.py``: 12 steps of 8 samples, validation every 4
steps, a checkpoint every 2) under one strategy and world size (``native``, ``native_ddp`` x2 and
x4, ``native_fsdp`` x2, ``xla_native``, ``xla_ddp`` x2; two torchrun workers, two torchrun nodes,
torchrun with ``--max-restarts=1``), hit by one fault (SIGTERM, SIGINT, SIGKILL, SIGUSR1, a hang in
the data or in a collective with ``exit_on_hang=True``, a full disk) aimed at one rank, the
launcher (one node's torchrun) or every process, at one point (a step, validation, an epoch's end,
the middle of a checkpoint write, whole or in the background, right after a resume, during the
first step's compilation), in one environment (PID 1 of a fresh PID namespace, a second run into
the same root at once), with damage before the resume (the newest checkpoint or the compilation
cache truncated, the checkpoint deleted, a relative or ``file://`` root, another working
directory). Then the run is resumed from ``last`` until it ends (under ``--max-restarts``,
torchrun's restarted workers do that themselves). After each run it checks:

- ``exit``: the documented exit code (143 SIGTERM, 130 SIGINT, 75 a hang with ``exit_on_hang``,
  killed by the signal where the launcher itself was killed, 0 after torchrun's restart, not 0
  after a full disk) on every launcher and on every rank that wrote one;
- ``bitwise``: the resumed run ends with weights ``torch.equal`` to an uninterrupted run's (and so
  does a run started beside it into the same root);
- ``published``: every ``*.ckpt`` under the root verifies (checksums) and loads; no ``.tmp-*``
  outlives a resumed run;
- ``orphans``: no process of the job outlives it (a few seconds' grace);
- ``budget``: no run outlasts its time budget (a hang);
- ``cause``: the error names the real cause (a killed rank: its rank and signal; a hang: a hang;
  a full disk: a full disk; a damaged compilation cache: the cache, in the last line).

A violation prints the scenario, what broke, its seed and the command that replays it; the exit
code is 1 when any scenario broke an invariant.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")
SCRIPT = os.path.join(TESTS, "chaos_run.py")
STEPS = 12
SCALE = float(os.environ.get("XTRAINER_TEST_TIMEOUT_SCALE") or 3.0)

#: (strategy, world size, launcher): ``trainer`` starts the processes (``devices=N``); ``torchrun``
#: is two torchrun workers of one process each on one host; ``nodes`` two torchrun commands of one
#: worker each ("nodes" on localhost, one c10d rendezvous); ``restarts`` one torchrun of two workers
#: with ``--max-restarts=1``, which restarts both after a worker failed (they resume from ``last``).
CONFIGS = [("native", 1, "trainer"), ("native_ddp", 2, "trainer"), ("native_ddp", 4, "trainer"),
           ("native_fsdp", 2, "trainer"), ("xla_native", 1, "trainer"), ("xla_ddp", 2, "trainer"),
           ("native_ddp", 2, "torchrun"), ("native_ddp", 2, "nodes"), ("native_ddp", 2, "restarts")]
#: ``HANG``: a hang in one rank's data; ``HANGC``: one rank stalls alone, the others wait in a
#: collective; ``FULL``: the runs root's filesystem (a small tmpfs) fills up.
FAULTS = ["TERM", "INT", "KILL", "USR1", "HANG", "HANGC", "FULL"]
TARGETS = ["rank", "launcher", "all"]
WHENS = ["step", "validation", "epoch_end", "save", "resume", "compile"]
DAMAGE = ["none", "none", "none", "truncate", "delete"]
ROOTS = ["absolute", "absolute", "relative", "file"]
#: ``pid1``: every run of the scenario is PID 1 of a fresh PID namespace (``unshare --pid``), as a
#: restarted container's process is; ``twin``: another run of the same fit starts at the same
#: moment into the same root.
ENVS = ["plain"] * 5 + ["pid1", "twin"]
GRACEFUL = {"TERM": 143, "INT": 130}
UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
#: The single-process configs whose first step compiles into a cache beside the run.
COMPILED = [("native", 1, "trainer"), ("xla_native", 1, "trainer")]


@dataclasses.dataclass
class Scenario:
    strategy: str
    devices: int
    launcher: str
    fault: str
    target: str
    rank: int
    when: str
    at: int
    async_: bool = False
    damage: str = "none"
    root: str = "absolute"
    cwd_change: bool = False
    env: str = "plain"

    @property
    def compiled(self) -> bool:
        return self.when == "compile"

    def __str__(self) -> str:
        who = f"rank {self.rank}" if self.target == "rank" else self.target
        if self.target == "launcher" and self.launcher == "nodes":
            who = f"rank {self.rank}'s node (its torchrun)"
        when = {"step": f"at step {self.at}", "validation": f"in validation after step {self.at}",
                "epoch_end": "at the first epoch's end", "save": f"while writing step {self.at}'s checkpoint",
                "resume": "right after resuming",
                "compile": f"once {self.at} files are in the compilation cache"}[self.when]
        extra = [f"damage {self.damage}" + (" to the cache" if self.compiled else "")] if self.damage != "none" else []
        extra += [f"{self.root} root"] if self.root != "absolute" else []
        extra += ["another cwd at resume"] if self.cwd_change else []
        extra += ["async checkpointing"] if self.async_ else []
        extra += [{"pid1": "as PID 1 of a fresh PID namespace", "twin": "a second run into the same root at once",
                   "plain": ""}[self.env]] if self.env != "plain" else []
        run = f"{self.strategy}x{self.devices}" + {"trainer": "", "torchrun": " under torchrun",
                                                   "nodes": " as two torchrun nodes",
                                                   "restarts": " under torchrun --max-restarts=1"}[self.launcher]
        run += " compiled" if self.compiled else ""
        fault = {"HANG": "hang in data", "HANGC": "stall alone (the others wait in a collective)",
                 "FULL": "the disk fills up"}.get(self.fault, f"SIG{self.fault}")
        aim = "" if self.fault == "FULL" else f" to {who}"
        return f"{run}: {fault}{aim} {when}" + (f" [{', '.join(extra)}]" if extra else "")


def draw(seed: int, index: int) -> Scenario:
    """Scenario ``index`` of ``seed``: drawn on its own, so that ``--only`` replays it alone."""
    rng = random.Random(f"{seed}-{index}")
    strategy, devices, launcher = rng.choice(CONFIGS)
    fault, target = rng.choice(FAULTS), rng.choice(TARGETS)
    when = rng.choices(WHENS, weights=[4, 2, 2, 3, 2, 1])[0]  # a compiled run is the slowest kind
    env = rng.choice(ENVS)
    if when == "compile":  # a single process compiles its first step into the cache beside the run
        strategy, devices, launcher = rng.choice(COMPILED)
        fault = rng.choice(["TERM", "INT", "KILL", "USR1"])
    if fault == "HANGC" and devices == 1:
        fault = "HANG"
    if fault in ("HANG", "HANGC", "FULL"):  # in one rank's data, hook, or the shared disk: at a step
        target, when = "rank", "step"
    if launcher == "restarts":  # torchrun restarts the workers after one of them failed
        target, fault = "rank", "KILL" if fault == "FULL" else fault
    if env == "pid1" and (launcher != "trainer" or when == "compile"):
        env = "plain"
    if env == "pid1":  # a container's process: the calling process, stopped or killed as a whole
        target, fault = "launcher", rng.choice(["TERM", "KILL"])
    if env == "twin" and (launcher != "trainer" or devices > 2 or when == "compile" or fault == "FULL"):
        env = "plain"
    at = {"step": rng.randint(2, 10), "validation": rng.choice([3, 7]), "epoch_end": 8,
          "save": rng.choice([2, 4, 6, 8, 10]), "resume": rng.randint(3, 8), "compile": rng.randint(1, 4)}[when]
    async_ = strategy in ("xla_native", "xla_ddp") and rng.random() < 0.5  # whole-file layouts
    root = rng.choice(ROOTS)
    damage = rng.choice(DAMAGE)
    if fault == "FULL":  # the root is on the small filesystem
        root, damage = "absolute", "none"
    if launcher == "restarts":  # the restarted workers resume themselves: nothing to damage between
        damage = "none"
    if when == "compile":
        damage = rng.choice(["none", "truncate", "truncate"])  # the cache's files, as a kill mid-write leaves them
    return Scenario(strategy, devices, launcher, fault, target, rng.randrange(devices), when, at, async_,
                    damage, root, cwd_change=root != "relative" and rng.random() < 0.25, env=env)


#: The fixed set CI runs, a few minutes: a graceful stop, a kill in a save, a hang in the data; one
#: process and two, the XLA runtime and the eager one; every kind of root and damage, another working
#: directory and a restart as PID 1. The soak draws the rest of the matrix.
QUICK = [
    Scenario("native", 1, "trainer", "TERM", "launcher", 0, "step", 5, damage="truncate", root="file",
             cwd_change=True),
    Scenario("native_ddp", 2, "trainer", "TERM", "rank", 1, "validation", 3, damage="delete", root="relative"),
    Scenario("native", 1, "trainer", "HANG", "rank", 0, "step", 5),
    Scenario("xla_native", 1, "trainer", "KILL", "launcher", 0, "save", 4, async_=True, damage="truncate"),
    Scenario("native", 1, "trainer", "KILL", "launcher", 0, "save", 6, env="pid1"),
]


class Violation(Exception):
    def __init__(self, category: str, what: str) -> None:
        super().__init__(f"{category}: {what}")
        self.category = category


def _env() -> dict:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("XTRAINER_STARTED_AT", None)
    return env


def _budget(s: Scenario) -> float:
    base = (40.0 if s.strategy.startswith("native") else 90.0) + 10.0 * max(0, s.devices - 2)
    base *= {"restarts": 2.0, "nodes": 1.5}.get(s.launcher, 1.0)  # two attempts; two torchruns
    base *= 1.5 if s.env == "twin" else 1.0  # two runs share the cores
    base += 120.0 if s.compiled else 0.0  # torch.compile's C++ compiler, XLA's compilation
    return base * SCALE + (30.0 if s.fault in ("HANG", "HANGC") else 0.0)


def _session(sid: int) -> list[int]:
    """Processes alive in session or process group ``sid`` (zombies excluded)."""
    found = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat).read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and sid in (int(fields[2]), int(fields[3])):
            found.append(int(stat.split("/")[2]))
    return found


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat).read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _kill_all(pids) -> None:
    for pid in pids:
        if pid <= 1 or pid == os.getpid():
            continue  # never the machine's init (a PID namespace's pid read by mistake), nor the harness
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _commands(s: Scenario, args: list[str]) -> list[list[str]]:
    """The command lines that start the scenario's job: one, or one per torchrun node."""
    from xtrainer.strategies.launchers.processes import free_port

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--monitor-interval=0.5"]
    if s.launcher == "torchrun":
        commands = [[*torchrun, f"--master-port={free_port()}", "--nproc-per-node=2", SCRIPT, *args]]
    elif s.launcher == "restarts":
        commands = [[*torchrun, f"--master-port={free_port()}", "--nproc-per-node=2", "--max-restarts=1", SCRIPT,
                     *args]]
    elif s.launcher == "nodes":
        endpoint, run_id = f"127.0.0.1:{free_port()}", f"chaos-{time.time_ns()}"
        commands = [[*torchrun, "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}", SCRIPT, *args] for node in range(2)]
    else:
        commands = [[sys.executable, SCRIPT, *args]]
    if s.env == "pid1":
        commands = [[*UNSHARE, *command] for command in commands]
    return commands


class Run:
    """One job of a scenario (one process tree, or one per torchrun node): started, watched, its
    leftovers found."""

    def __init__(self, s: Scenario, work: str, root: str, state: str, cwd: str, ckpt: str | None,
                 fault: bool, fill: str | None = None) -> None:
        os.makedirs(state, exist_ok=True)
        for name in os.listdir(state):
            os.remove(os.path.join(state, name))
        ckpt = ckpt or ("last" if s.launcher == "restarts" else None)  # every worker torchrun starts resumes
        args = ["--strategy", s.strategy, "--devices", str(s.devices), "--root", root, "--state", state,
                "--steps", str(STEPS)]
        args += ["--ckpt", ckpt] if ckpt else []
        args += ["--async"] if s.async_ else []
        args += ["--compile"] if s.compiled else []
        if fault:
            args += ["--fault", s.fault, "--target", s.target, "--rank", str(s.rank), "--when", s.when,
                     "--at", str(s.at), "--hang-timeout", str(4 * SCALE)]
            args += ["--fill", fill] if fill else []
            args += ["--outside-kill"] if s.env == "pid1" else []
        self.s, self.state, self.started = s, state, time.monotonic()
        self.logs, self.procs = [], []
        for command in _commands(s, args):
            log = open(os.path.join(os.path.dirname(state), f"log-{time.time_ns()}.txt"), "w+")
            self.logs.append(log)
            self.procs.append(subprocess.Popen(command, cwd=cwd, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True))
        if s.launcher != "trainer" and s.env != "pid1":  # the torchruns, for a fault to every process
            for i, proc in enumerate(self.procs):
                with open(os.path.join(state, f"launcher-{i}.pid"), "w") as f:
                    f.write(str(proc.pid))
        self.proc = self.procs[0]
        self.seen: set[int] = set()
        self.kill_sent = False

    def wait(self, budget: float) -> tuple[int | tuple[int, ...], str]:
        """The exit code (one per torchrun node where there are several) and the output; a run
        past ``budget`` is killed and raises ``budget``."""
        deadline = self.started + budget
        while any(proc.poll() is None for proc in self.procs):
            for proc in self.procs:
                self.seen |= _descendants(proc.pid)
            request = os.path.join(self.state, "kill-request")
            if not self.kill_sent and os.path.exists(request):  # PID 1 of a namespace: killed from outside
                self.kill_sent = True
                os.kill(self.proc.pid, getattr(signal, f"SIG{open(request).read().strip() or 'KILL'}"))
            if time.monotonic() > deadline:
                self._end()
                raise Violation("budget", f"still running after {budget:.0f} s:\n{self.output()[-1500:]}")
            time.sleep(0.2)
        self.took = time.monotonic() - self.started
        codes = tuple(proc.returncode for proc in self.procs)
        return (codes if len(codes) > 1 else codes[0]), self.output()

    def output(self) -> str:
        texts = []
        for log in self.logs:
            log.flush()
            log.seek(0)
            texts.append(log.read())
        return "\n".join(texts)

    def pids(self) -> set[int]:
        found = set(self.seen)
        if self.s.env != "pid1":  # in a PID namespace the files hold the namespace's pids
            for path in glob.glob(os.path.join(self.state, "*.pid")):
                try:
                    found.add(int(open(path).read()))
                except (OSError, ValueError):
                    pass
        return found - {proc.pid for proc in self.procs}

    def _sessions(self) -> set[int]:
        return {pid for proc in self.procs for pid in _session(proc.pid)}

    def leftovers(self, grace: float = 5.0) -> list[int]:
        """The job's processes still alive ``grace`` seconds after it ended (then killed)."""
        deadline = time.monotonic() + grace
        while True:
            left = sorted({p for p in self.pids() if _alive(p)} | self._sessions())
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        _kill_all(left)
        return left

    def _end(self) -> None:
        _kill_all(self.pids() | self._sessions())
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()

    def codes(self) -> dict[int, str]:
        return {int(os.path.basename(p)[5:-5]): open(p).read() for p in glob.glob(os.path.join(self.state, "main-*.exit"))}

    def fired(self) -> bool:
        return os.path.exists(os.path.join(self.state, "fired"))


def _local_root(root: str, cwd: str) -> str:
    if root.startswith("file://"):
        return root[len("file://"):]
    return root if os.path.isabs(root) else os.path.join(cwd, root)


def _checkpoints(root: str) -> list[str]:
    return sorted(glob.glob(os.path.join(root, "**", "*.ckpt"), recursive=True))


def check_published(root: str, spare: set[str], resumed: bool) -> None:
    """Every checkpoint under ``root`` (but the ones the scenario damaged) verifies and loads;
    after a resumed run no temporary file is left."""
    import torch

    from xtrainer import checkpoint

    for path in _checkpoints(root):
        real = os.path.realpath(path)
        if real in spare or path in spare:
            continue
        if os.path.islink(path) and not os.path.exists(real):
            if resumed:
                raise Violation("published", f"{path} points at {real}, which is gone")
            continue
        try:
            if os.path.isdir(real):
                if not os.path.exists(os.path.join(real, "manifest.json")):
                    raise Violation("published", f"{path} is a folder without its manifest")
                checkpoint.verify(real)
            else:
                checkpoint.verify(real)
                checkpoint.load_checkpoint(real)
                torch.load(real, weights_only=True, map_location="cpu")
        except Violation:
            raise
        except Exception as err:  # noqa: BLE001 - any failure to read a published checkpoint
            raise Violation("published", f"{path} does not load: {type(err).__name__}: {str(err)[:300]}") from err
    if resumed:
        temps = [p for p in glob.glob(os.path.join(root, "**", ".tmp-*"), recursive=True)
                 + glob.glob(os.path.join(root, "**", ".*staging*"), recursive=True)]
        if temps:
            raise Violation("published", f"temporary files outlived the resumed run: {temps}")


def _signal_name(fault: str) -> str:
    return f"SIG{fault}"


def ended_before_the_stop(s: Scenario, launchers: list, ranks: dict[int, str], finished: bool) -> bool:
    """Whether a graceful stop fell on the fit's last step, so that the fit ended, as documented:
    every process exited 0 and rank 0 saved the finished weights. A torchrun that was itself
    signalled exits 1 all the same (its own ``SignalException``, whatever its workers did): then
    every rank's 0 is what counts (chaos seed 11000 #69)."""
    if s.fault not in GRACEFUL or not finished:
        return False
    if set(launchers) == {0}:
        return True
    torchrun_signalled = s.launcher != "trainer" and s.target in ("launcher", "all")
    return torchrun_signalled and len(ranks) == s.devices and set(ranks.values()) == {"0"}


def check_exit(s: Scenario, run: Run, code, out: str) -> None:
    """The launchers' exit codes and every rank's, as documented for the fault."""
    fault = s.fault
    codes = run.codes()
    tail = out[-2500:]
    launchers = list(code) if isinstance(code, tuple) else [code]
    torchrun = s.launcher != "trainer"
    hung = "hung" in out or (s.strategy == "xla_ddp" and "waits more than" in out)
    if s.launcher == "restarts" and s.target == "rank":  # torchrun restarted the failed workers: they resumed
        if code != 0 or len(codes) != s.devices or any(c != "0" for c in codes.values()):
            raise Violation("exit", f"torchrun --max-restarts=1 exited {code}, ranks {codes}, expected 0 everywhere "
                                    f"after the restart:\n{tail}")
        if fault in ("HANG", "HANGC") and not hung:
            raise Violation("cause", f"a hang that never says so:\n{tail}")
        return
    if fault in GRACEFUL:
        want = GRACEFUL[fault]
        if torchrun:
            if 0 in launchers or any(c != str(want) for c in codes.values()) or len(codes) != s.devices:
                raise Violation("exit", f"torchrun exited {code}, ranks {codes}, expected {want} on every rank:\n{tail}")
        elif code != want:
            raise Violation("exit", f"exited {code}, expected {want}:\n{tail}")
        return
    if fault in ("HANG", "HANGC"):
        if torchrun:
            if 0 in launchers or codes.get(s.rank) not in ("75", None):
                raise Violation("exit", f"torchrun exited {code}, ranks {codes}, expected 75 on the hung rank:\n{tail}")
        elif code not in (75, -signal.SIGKILL) and not (s.strategy == "xla_ddp" and code == 1
                                                          and "waits more than" in out):
            # (xla_ddp's replicas are threads of one process on the CPU runtime: XLA aborts a
            # collective wait past 10 s, before a longer hang_timeout, and the error says so)
            raise Violation("exit", f"exited {code}, expected 75 (exit_on_hang):\n{tail}")
        if not hung:
            raise Violation("cause", f"a hang that never says so:\n{tail}")
        return
    if fault == "FULL":
        if 0 in launchers:
            raise Violation("exit", f"a job whose disk filled up exited {code}, ranks {codes}:\n{tail}")
        if "The disk is full" not in out:
            raise Violation("cause", f"the error does not say the disk is full:\n{tail}")
        return
    signum = getattr(signal, f"SIG{fault}")
    hits_launcher = s.target in ("launcher", "all") or (
        s.target == "rank" and s.launcher == "trainer" and (s.devices == 1 or (s.rank == 0 and not s.strategy.startswith("xla"))))
    if hits_launcher:
        if s.launcher == "nodes" and s.target == "launcher":  # one node's torchrun killed, the other fails
            if sorted(launchers).count(-signum) != 1 or 0 in launchers:
                raise Violation("exit", f"the torchruns exited {code}, expected one killed by SIG{fault} and the "
                                        f"other failing:\n{tail}")
        elif any(c != -signum for c in launchers):
            raise Violation("exit", f"exited {code}, expected {-signum} (killed by SIG{fault}):\n{tail}")
        return
    if 0 in launchers:
        raise Violation("exit", f"a job that lost a process to SIG{fault} exited {code}:\n{tail}")
    named = _signal_name(fault) in out or f"signal {signum}" in out.lower() or f"Signal {signum}" in out
    if not named:
        raise Violation("cause", f"the error does not name SIG{fault}:\n{tail}")
    if s.strategy.startswith("native") and s.launcher == "trainer" and f"rank {s.rank}" not in out.lower():
        raise Violation("cause", f"the error does not name rank {s.rank}:\n{tail}")
    for wrong in ("No space left", "disk is full", "full disk"):
        if wrong in out:
            raise Violation("cause", f"a lost process reported as {wrong!r}:\n{tail}")


def _damage(s: Scenario, root: str) -> set[str]:
    """Truncates or deletes the checkpoint a resume from ``last`` reads first, as a kill mid-write
    leaves it: the one the newest ``last.ckpt`` names (Lightning's rule: a kill between a step's
    checkpoint and its ``last`` link leaves ``last`` on the step before, and the newer file unread),
    else the newest published checkpoint."""
    if s.damage == "none":
        return set()
    found = [p for p in _checkpoints(root) if not os.path.islink(p) and os.path.isfile(p)]
    folders = [p for p in _checkpoints(root) if not os.path.islink(p) and os.path.isdir(p)]
    if not found and not folders:
        return set()
    lasts = [p for p in _checkpoints(root) if os.path.basename(p) == "last.ckpt" and os.path.exists(p)]
    newest = (os.path.realpath(max(lasts, key=os.path.getmtime)) if lasts
              else max(found + folders, key=os.path.getmtime))
    if os.path.isdir(newest):  # a sharded folder: damage its largest file
        files = [os.path.join(d, f) for d, _, fs in os.walk(newest) for f in fs]
        target = max(files, key=os.path.getsize)
    else:
        target = newest
    if s.damage == "delete":
        os.remove(target)
    else:
        with open(target, "r+b") as f:
            f.truncate(os.path.getsize(target) // 2)
    return {os.path.realpath(newest), newest}


def _damage_cache(root: str) -> list[str]:
    """Truncates to half the files of the compilation caches beside the run that a kill in the
    middle of their write leaves cut short: the C++ compiler's outputs in Inductor's (``.o``,
    ``.so``: written in place; Inductor writes its sources, graphs and wrapper modules whole, by
    rename), every entry in XLA's. Returns them."""
    damaged = []
    for name in ("inductor_cache", "xla_cache"):
        for folder, _, files in os.walk(os.path.join(root, name)):
            for file in files:
                path = os.path.join(folder, file)
                if name == "inductor_cache" and not file.endswith((".o", ".so")):
                    continue
                if os.path.isfile(path) and not os.path.islink(path) and os.path.getsize(path) > 1:
                    with open(path, "r+b") as f:
                        f.truncate(os.path.getsize(path) // 2)
                    damaged.append(path)
    return damaged


def _mount_small_disk(path: str, size: str = "2m") -> bool:
    """A real filesystem of ``size`` at ``path`` (a tmpfs: needs root); False where none can be."""
    os.makedirs(path, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                          capture_output=True).returncode == 0


def reference(s: Scenario, work: str) -> dict:
    """The weights of the same config never interrupted (computed once per config)."""
    import torch

    key = f"{s.strategy}-{s.devices}-{s.launcher}" + ("-compiled" if s.compiled else "")
    path = os.path.join(work, "references", f"{key}.pt")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f"ref-{key}-", dir=work)
        clean = dataclasses.replace(s, async_=False, damage="none", root="absolute", cwd_change=False, env="plain")
        run = Run(clean, work, os.path.join(tmp, "runs"), os.path.join(tmp, "state"), tmp, None, fault=False)
        code, out = run.wait(_budget(s) * 2)
        if code not in (0, (0, 0)):
            raise RuntimeError(f"the uninterrupted run of {key} failed ({code}):\n{out[-3000:]}")
        shutil.copy(os.path.join(tmp, "state", "weights.pt"), path)
        shutil.rmtree(tmp, ignore_errors=True)
    return torch.load(path, weights_only=True)


def run_scenario(s: Scenario, work: str) -> str:
    """Runs ``s`` and its resumes; returns ``survived`` or ``missed`` (the fault never came: the
    fit ended first; or the row cannot run here), raises ``Violation``."""
    import torch

    expected = reference(s, work)
    folder = tempfile.mkdtemp(prefix="scenario-", dir=work)
    first_cwd, later_cwd = os.path.join(folder, "cwd-a"), os.path.join(folder, "cwd-b" if s.cwd_change else "cwd-a")
    os.makedirs(first_cwd)
    os.makedirs(later_cwd, exist_ok=True)
    disk = None
    if s.fault == "FULL":  # the runs root on a small filesystem of its own, which the fault fills up
        disk = os.path.join(folder, "disk")
        if not _mount_small_disk(disk):
            shutil.rmtree(folder, ignore_errors=True)
            print("  (no small tmpfs can be mounted here: needs root)", flush=True)
            return "missed"
    if s.env == "pid1" and subprocess.run([*UNSHARE, "true"], capture_output=True).returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        print("  (unshare --pid is not permitted here: needs root)", flush=True)
        return "missed"
    absolute = os.path.join(disk or first_cwd, "runs")
    root = {"absolute": absolute, "relative": "runs", "file": "file://" + absolute}[s.root]
    local = _local_root(root, first_cwd)
    state = os.path.join(folder, "state")
    budget = _budget(s)
    resumed = False
    try:
        if s.when == "resume":  # first a graceful stop, so that the fault meets a resumed run
            stop = dataclasses.replace(s, fault="TERM", target="launcher", when="step")
            run = Run(stop, work, root, state, first_cwd, None, fault=True)
            code, out = run.wait(budget)
            if not run.fired():
                raise Violation("exit", f"the stop before the resume never came (exit {code}):\n{out[-2500:]}")
            check_exit(stop, run, code, out)
            _check_leftovers(run)
            resumed = True
        twin = None
        if s.env == "twin":  # the same fit, started at the same moment into the same root, never faulted
            twin = Run(s, work, root, os.path.join(folder, "state-twin"), first_cwd, "last" if resumed else None,
                       fault=False)
        try:
            run = Run(s, work, root, state, first_cwd, "last" if resumed else None, fault=True, fill=disk)
            code, out = run.wait(budget)
            _check_leftovers(run)
            if twin is not None:
                twin_code, twin_out = twin.wait(budget)
                _check_leftovers(twin)
        finally:
            if twin is not None and any(proc.poll() is None for proc in twin.procs):
                twin._end()  # the scenario failed first: the run beside it goes too
        if twin is not None:
            if twin_code != 0:
                raise Violation("exit", f"the run beside it in the same root exited {twin_code}:\n{twin_out[-2500:]}")
            _check_bitwise(os.path.join(folder, "state-twin"), expected, "the run beside it in the same root")
        launchers = list(code) if isinstance(code, tuple) else [code]
        if not run.fired():
            if any(c != 0 for c in launchers):
                raise Violation("exit", f"exited {code} before its fault came:\n{out[-2500:]}")
            return "missed"
        restarted = s.launcher == "restarts" and s.target == "rank"
        if not restarted and ended_before_the_stop(s, launchers, run.codes(),
                                                   os.path.exists(os.path.join(state, "weights.pt"))):
            return "missed"
        check_exit(s, run, code, out)
        if restarted:  # the restarted workers resumed from last themselves
            check_published(local, set(), resumed=True)
            _check_bitwise(state, expected, "the run torchrun restarted")
            return "survived"
        check_published(local, set(), resumed=False)
        if disk is not None:
            os.remove(os.path.join(disk, "filler"))  # room again, for the resume
        damaged_cache = _damage_cache(local) if s.compiled and s.damage != "none" else []
        spare = set() if s.compiled else _damage(s, local)
        resume_root = root if s.root != "relative" else os.path.relpath(absolute, later_cwd)
        only = spare and not [p for p in _checkpoints(local) if not os.path.islink(p)
                              and os.path.realpath(p) not in spare and os.path.exists(p)]
        run = Run(s, work, resume_root, state, later_cwd, "last", fault=False)
        code, out = run.wait(budget)
        _check_leftovers(run)
        # nothing else to resume from, and it is damaged (truncated, or a sharded folder that lost a
        # file; a whole file deleted leaves nothing, and the resume starts afresh): refused, naming it
        if only and (s.damage == "truncate" or any(os.path.isdir(p) for p in spare)):
            if code == 0 or not any(os.path.basename(p) in out for p in spare):
                raise Violation("cause", f"the resume from a lineage whose one checkpoint is damaged exited {code} "
                                         f"without naming it:\n{out[-2500:]}")
            return "survived"
        if damaged_cache and code != 0:  # may fail, in one line naming the cache
            last = [line for line in out.strip().splitlines() if line.strip()][-1:]
            if not last or "compilation cache" not in last[0] or not any(
                    name in last[0] for name in ("inductor_cache", "xla_cache")):
                raise Violation("cause", f"the run after the damaged cache ({len(damaged_cache)} files) exited {code} "
                                         f"without an error naming the cache:\n{out[-2500:]}")
            return "survived"
        if code not in (0, (0, 0)):
            raise Violation("exit", f"the resumed run exited {code}:\n{out[-2500:]}")
        check_published(local, spare, resumed=True)
        _check_bitwise(state, expected, "the resumed run")
        if s.damage == "truncate" and spare and not any(os.path.basename(p) in out for p in spare):
            raise Violation("cause", f"the resume does not name the damaged checkpoint {sorted(spare)}:\n{out[-2500:]}")
        return "survived"
    finally:
        if disk is not None:
            subprocess.run(["umount", "-l", disk], capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


def _check_bitwise(state: str, expected: dict, what: str) -> None:
    """The weights a finished run wrote into ``state`` equal the uninterrupted run's, bit for bit."""
    import torch

    path = os.path.join(state, "weights.pt")
    if not os.path.exists(path):
        raise Violation("bitwise", f"{what} wrote no final weights")
    final = torch.load(path, weights_only=True)
    if final["global_step"] != STEPS:
        raise Violation("bitwise", f"{what} ended at step {final['global_step']}, not {STEPS}")
    differ = [k for k, v in expected["weights"].items() if not torch.equal(final["weights"][k], v)]
    if differ:
        worst = max((final["weights"][k] - expected["weights"][k]).abs().max().item() for k in differ)
        raise Violation("bitwise", f"{what}: {differ} differ from the uninterrupted run (at most {worst:.3g})")


def _commit() -> str:
    """The code's commit, with ``+`` where the working tree differs from it (``XTRAINER_CHAOS_COMMIT``
    where the code is an exported copy)."""
    if os.environ.get("XTRAINER_CHAOS_COMMIT"):
        return os.environ["XTRAINER_CHAOS_COMMIT"]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "xtrainer"], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()
    return head + ("+" if dirty else "")


def _check_leftovers(run: Run) -> None:
    left = run.leftovers()
    if left:
        raise Violation("orphans", f"processes outlived the job: {left}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--soak", type=int, default=0, help="draw this many random scenarios")
    parser.add_argument("--quick", action="store_true", help="the fixed set CI runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", type=int, action="append", help="only scenario K (repeatable)")
    parser.add_argument("--minutes", type=float, default=0, help="stop drawing after this many minutes")
    parser.add_argument("--work", default=None, help="a folder for the runs and the cached references")
    parser.add_argument("--log", default=None, help="append one JSON line per scenario to this file")
    args = parser.parse_args()
    if args.quick:
        scenarios = {k: QUICK[k] for k in (args.only or range(len(QUICK)))}
    else:
        count = args.soak or 1
        scenarios = {k: draw(args.seed, k) for k in (args.only or range(count))}
    work = args.work or tempfile.mkdtemp(prefix="xtrainer-chaos-")
    os.makedirs(work, exist_ok=True)
    started = time.monotonic()
    table: dict[str, dict[str, int]] = {}
    failures = []
    for k, s in scenarios.items():
        if args.minutes and time.monotonic() - started > args.minutes * 60:
            print(f"stopping: {args.minutes} minutes are up", flush=True)
            break
        replay = f"python benchmarks/chaos.py {'--quick' if args.quick else f'--seed {args.seed}'} --only {k}"
        t0 = time.monotonic()
        try:
            verdict, detail = run_scenario(s, work), ""
        except Violation as err:
            verdict, detail = "violation", str(err)
            failures.append((k, s, err.category, replay))
        for category in (f"fault {s.fault}", f"strategy {s.strategy}x{s.devices}"
                         + ("" if s.launcher == "trainer" else f"/{s.launcher}"), f"when {s.when}", f"env {s.env}",
                         "all"):
            row = table.setdefault(category, {"run": 0, "survived": 0, "missed": 0, "violations": 0})
            row["run"] += 1
            row[{"survived": "survived", "missed": "missed", "violation": "violations"}[verdict]] += 1
        print(f"#{k} {s}: {verdict} ({time.monotonic() - t0:.0f} s)", flush=True)
        if args.log:
            with open(args.log, "a") as log:
                log.write(json.dumps({"seed": None if args.quick else args.seed, "index": k, "scenario": str(s),
                                      "verdict": verdict, "seconds": round(time.monotonic() - t0),
                                      "commit": _commit(), "detail": detail[:2000], "replay": replay}) + "\n")
        if detail:
            print(f"  {detail}\n  seed {args.seed}, replay: {replay}", flush=True)
    print(f"\n{'category':<34} {'run':>5} {'survived':>9} {'missed':>7} {'violations':>11}")
    for category in sorted(table, key=lambda c: (c == "all", c)):
        row = table[category]
        print(f"{category:<34} {row['run']:>5} {row['survived']:>9} {row['missed']:>7} {row['violations']:>11}")
    print(f"{time.monotonic() - started:.0f} s in all; runs in {work}")
    for k, s, category, replay in failures:
        print(f"VIOLATION ({category}) #{k} {s}: {replay}")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
