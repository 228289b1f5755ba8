"""Goodput on real pods: the persistent compilation cache, the hang watchdog, MFU, goodput
accounting and ``xtrainer doctor``, on the CPU runtime, in real processes."""

import glob
import json
import os
import re
import signal
import subprocess
import sys
import threading

import conftest
import pytest
from conftest import Regressor, make_loader, subprocess_timeout

from xtrainer import Trainer, _xla, compile_cache
from xtrainer.callbacks import Callback, XlaHealth

HERE = os.path.dirname(os.path.abspath(conftest.__file__))


def run_fit(root, timeout=240, env=None, **options):
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE)]),
           **(env or {})}
    return subprocess.run([sys.executable, os.path.join(HERE, "goodput_run.py"), str(root), json.dumps(options)],
                          capture_output=True, text=True, timeout=subprocess_timeout(timeout), env=env)


def cache_line(out):
    return next(line for line in out.splitlines() if "compilation cache" in line)


def test_each_process_has_its_own_cache_folder_and_a_second_process_finds_every_graph(tmp_path):
    cache = tmp_path / "cache"
    first = run_fit(tmp_path / "runs", compilation_cache=str(cache))
    assert first.returncode == 0, first.stderr[-3000:]
    written = os.listdir(cache / "rank_0")  # one replica in the process: its global rank
    line = cache_line(first.stdout)
    loaded = int(re.search(r"(\d+) of (\d+) graphs loaded", line).group(2))
    assert written and loaded >= len(written), line  # every graph compiled was looked up, and written

    second = run_fit(tmp_path / "runs", compilation_cache=str(cache), ckpt_path="last", steps=16)
    assert second.returncode == 0, second.stderr[-3000:]
    line = cache_line(second.stdout)
    hits, lookups = map(int, re.search(r"(\d+) of (\d+) graphs loaded", line).groups())
    unloadable = int(re.search(r"(\d+) found but NOT loadable", line).group(1)) if "NOT loadable" in line else 0
    # The second process looked every graph of the first up and found its file: loaded (a hit),
    # or, on the CPU runtime, found and refused by the CPU client (compile_cache's docstring).
    assert hits + unloadable >= len(written), line
    if hits == 0:
        assert "did NOT hit" in line and "cannot load cached executables" in line, line
        assert "Deserializing serialized executable not supported" in second.stderr
    assert sorted(os.listdir(cache)) == ["rank_0"]


def test_thread_replicas_share_one_process_folder_and_the_default_is_off_on_the_cpu_runtime(tmp_path):
    on = run_fit(tmp_path / "runs", compilation_cache=True, devices=2, steps=4)
    assert on.returncode == 0, on.stderr[-3000:]
    assert os.listdir(tmp_path / "runs" / "xla_cache") == ["process_0"]  # two replicas, one process
    assert os.listdir(tmp_path / "runs" / "xla_cache" / "process_0")
    default = run_fit(tmp_path / "default", steps=4)
    assert default.returncode == 0, default.stderr[-3000:]
    assert "compilation cache off" in default.stdout
    assert not os.path.exists(tmp_path / "default" / "xla_cache")
    # A cache the environment names is the user's choice: used (one folder per process under it).
    named = run_fit(tmp_path / "named", steps=4, env={"XLA_PERSISTENT_CACHE_PATH": str(tmp_path / "mine")})
    assert named.returncode == 0, named.stderr[-3000:]
    assert os.listdir(tmp_path / "mine") == ["rank_0"] and os.listdir(tmp_path / "mine" / "rank_0")


def test_cache_folders_per_process(tmp_path):
    assert compile_cache.process_folder("/c", 1, 3, 0) == "/c/rank_3"
    assert compile_cache.process_folder("/c", 4, 0, 1) == "/c/process_1"
    assert compile_cache.folder_for(False, str(tmp_path)) is None
    assert compile_cache.folder_for(True, str(tmp_path)) == str(tmp_path / "xla_cache")
    assert compile_cache.folder_for(str(tmp_path / "x"), "/elsewhere") == str(tmp_path / "x")


def test_a_step_that_sleeps_past_the_limit_leaves_stacks_naming_it_and_the_run_goes_on(tmp_path):
    run = run_fit(tmp_path, hang_timeout=1.5, sleep_at=3, sleep_s=5, steps=6)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "no training step finished for" in run.stderr and "sleep_inside_the_step" in run.stderr
    [stacks] = [p for p in glob.glob(str(tmp_path / "version_0" / "hang-*.txt"))]
    text = open(stacks).read()
    assert "hang_timeout=1.5" in text and "innermost call first" in text
    frames = text.split("Current thread")[1]  # the main thread, which took the monitor's signal
    assert frames.index("in sleep_inside_the_step") < frames.index("in on_train_batch_start") < frames.index(" in run")


def test_exit_on_hang_ends_a_process_that_still_runs_python_with_exit_code_75(tmp_path):
    run = run_fit(tmp_path, hang_timeout=3, exit_on_hang=True, sleep_at=4, sleep_s=120, steps=6)
    assert run.returncode == 75, run.stderr[-3000:]
    assert "exit code 75" in run.stderr and "SIGKILL" not in run.stderr
    [stacks] = glob.glob(str(tmp_path / "version_0" / "hang-*.txt"))
    assert "in sleep_inside_the_step" in open(stacks).read()


def test_a_process_stuck_in_c_holding_the_gil_still_gives_its_stacks_and_is_killed_on_exit_on_hang(tmp_path):
    # No thread of the process can run Python here: a watchdog thread would never get the GIL.
    run = run_fit(tmp_path, hang_timeout=3, exit_on_hang=True, deadlock_at=4, steps=6)
    assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
    assert "did not end within" in run.stderr and "SIGKILL" in run.stderr
    [stacks] = glob.glob(str(tmp_path / "version_0" / "hang-*.txt"))
    text = open(stacks).read()
    assert "in stuck_in_c_holding_the_gil" in text and "in on_train_batch_start" in text


def test_exit_on_hang_ends_the_run_with_thread_replicas(tmp_path):
    # The limit leaves room for the first steps' compilations on a busy machine. The replicas'
    # threads cannot install a signal handler (only a main thread can): the replicas' process's
    # main thread holds it, and the process ends with the hang's exit code, which its caller
    # raises as RunHung (a SIGKILL it could not tell from any other kill; found by the chaos harness).
    run = run_fit(tmp_path, hang_timeout=10, exit_on_hang=True, sleep_at=4, sleep_s=120, steps=6, devices=2)
    assert "the run looks hung; ending process" in run.stderr and "SIGKILL" not in run.stderr, run.stderr[-3000:]
    assert "RunHung: The replicas' process was ended by the hang watchdog" in run.stderr, run.stderr[-3000:]
    [stacks] = glob.glob(str(tmp_path / "version_0" / "hang-*.txt"))
    text = open(stacks).read()
    assert text.count(" in sleep_inside_the_step") == 2  # both replicas (threads of one process) sleep there


def test_a_run_that_keeps_stepping_never_fires(tmp_path):
    run = run_fit(tmp_path, hang_timeout=20, steps=8)
    assert run.returncode == 0, run.stderr[-3000:]
    assert not glob.glob(str(tmp_path / "version_0" / "hang-*.txt")) and "no training step" not in run.stderr


def test_the_automatic_limit_waits_for_compilations_then_follows_the_median_step():
    from xtrainer.launch.watchdog import FLOOR, STARTUP_LIMIT, HangWatchdog

    watchdog = HangWatchdog()
    assert watchdog.limit([], 0) == STARTUP_LIMIT
    assert watchdog.limit([0.1] * 50, 50) == FLOOR  # never less than a few minutes
    assert watchdog.limit([60.0] * 9 + [3000.0], 10) == 1200.0  # 20 x the median, not the mean
    assert HangWatchdog(2).limit([], 0) == 2.0
    with pytest.raises(ValueError, match="hang_timeout"):
        Trainer(hang_timeout=-1)


def test_the_monitor_reads_progress_from_the_shared_counters_and_estimates_the_time_between_batches():
    from xtrainer.launch.hang_monitor import Watch

    counters = [5, 0]  # training batches finished, other progress: as the training process stores them
    watch = Watch(counters, now=100.0)
    watch.read(101.0)
    assert (watch.steps, watch.last, list(watch.intervals)) == (0, 100.0, [])  # nothing finished: idle since the start
    counters[0] = 15
    watch.fired = True
    watch.read(103.0)
    assert (watch.steps, watch.last, watch.fired) == (10, 103.0, False)
    assert list(watch.intervals) == [pytest.approx(0.3)]  # 10 batches in the 3 s since the watch began
    counters[1] += 1  # a validation batch: progress, but no step time
    watch.read(110.0)
    assert (watch.steps, watch.last, len(watch.intervals)) == (10, 110.0, 1)


def test_the_training_process_runs_no_thread_for_the_watchdog_and_its_monitor_ends_with_the_fit(tmp_path):
    from xtrainer.strategies import NativeSingle

    def monitors():
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        cmd = f.read().split(b"\0")
                    with open(f"/proc/{entry}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except OSError:
                    continue
                if ppid == os.getpid() and any(part.endswith(b"hang_monitor.py") for part in cmd):
                    found.append(int(entry))
        return found

    class Look(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 2:
                self.threads = set(threading.enumerate())
                self.monitors = monitors()
                self.progress = int(trainer.loop.progress[0])

    before = set(threading.enumerate())
    look = Look()
    Trainer(strategy=NativeSingle(), max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=[look]).fit(
        Regressor(), make_loader(64, 8))
    assert look.threads <= before  # no thread of its own (one of a pytest plugin's may have ended)
    assert len(look.monitors) == 1 and look.progress == 2  # batches 0 and 1 were stored when batch 2 ended
    assert monitors() == []  # ended and reaped with the fit


def test_a_monitor_that_cannot_start_leaves_a_warning_and_the_run_goes_on(tmp_path, monkeypatch):
    from xtrainer.strategies import NativeSingle

    monkeypatch.setattr(sys, "executable", "")  # an embedding interpreter with no executable to start
    with pytest.warns(UserWarning, match="hang watchdog could not start its monitor process"):
        trainer = Trainer(strategy=NativeSingle(), max_steps=3, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
        trainer.fit(Regressor(), make_loader(64, 8))
    assert trainer.global_step == 3 and trainer.loop.progress is None


# ---- MFU and tokens per second ----------------------------------------------------------------
class Recorder(Callback):
    """Collects the values handed to the loggers (``on_metrics``)."""

    def __init__(self):
        self.logged = []

    def on_metrics(self, trainer, module, metrics, step):
        self.logged.append(dict(metrics))


def fit_with_health(tmp_path, module, **kwargs):
    health, recorder = XlaHealth(), Recorder()
    kwargs.setdefault("strategy", "xla_native")  # XLA's counters and chips
    trainer = Trainer(max_steps=6, log_every_n_steps=2, default_root_dir=str(tmp_path), logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, callbacks=[health, recorder], **kwargs)
    trainer.fit(module, make_loader(64, 8))
    return trainer, health, recorder


def test_model_flops_are_counted_once_from_the_step_and_reported_as_achieved_flops_on_cpu(tmp_path, capsys):
    trainer, health, recorder = fit_with_health(tmp_path, Regressor())
    # Linear(8, 16) and Linear(16, 1) on 8 samples: forward 2*8*8*16 + 2*8*16*1; backward the
    # weight gradients of both and the input gradient of the second (the data needs none).
    assert health._work.flops == (2 * 8 * 8 * 16 + 2 * 8 * 16) + (2 * 8 * 8 * 16 + 2 * 2 * 8 * 16)
    flops_logged = [m["throughput/model_flops_per_second"] for m in recorder.logged
                    if "throughput/model_flops_per_second" in m]
    assert flops_logged and all(v > 0 for v in flops_logged)
    assert not any("throughput/mfu" in m for m in recorder.logged)  # the CPU runtime has no peak
    assert trainer.progress_bar_metrics["flop/s"] == flops_logged[-1]
    out = capsys.readouterr().out
    assert "model FLOPs per optimizer step (counted on the meta device)" in out
    assert "no MFU: no peak FLOP/s for the CPU runtime" in out


class DeclaredLM(Regressor):
    flops_per_step = 1e9

    def tokens_per_step(self, batch):
        return 4 * batch[0].shape[0]  # declared: 4 tokens per sample


@pytest.mark.parametrize("strategy", ["xla_native", "native"])
def test_declared_flops_and_tokens_and_a_chips_peak_give_mfu(tmp_path, monkeypatch, capsys, strategy):
    """The chip's peak comes from the runtime (XLA's chip, a CUDA device's name; XTRAINER_CHIP
    names it where it cannot be told, as on this machine)."""
    monkeypatch.setenv("XTRAINER_CHIP", "tpu-v5e")  # pick the table's entry, as on a v5e host
    trainer, health, recorder = fit_with_health(tmp_path, DeclaredLM(), strategy=strategy)
    interval = [m for m in recorder.logged if "throughput/mfu" in m]
    assert interval
    for m in interval:
        assert m["throughput/mfu"] == pytest.approx(m["throughput/model_flops_per_second"] / 197e12)
        steps_per_s = m["throughput/steps_per_second"]
        assert m["throughput/model_flops_per_second"] == pytest.approx(1e9 * steps_per_s, rel=0.05)
        assert m["throughput/tokens_per_second"] == pytest.approx(32 * steps_per_s, rel=0.05)
    assert "mfu" in trainer.progress_bar_metrics
    out = capsys.readouterr().out
    assert "(declared by the module)" in out and "of 1 tpu-v5e chip(s)" in out and "tokens/s" in out


def test_flops_counting_the_watchdog_and_goodput_add_no_graph_execution_or_transfer(tmp_path):
    def counts(**kwargs):
        _xla.wait_device_ops()
        _xla.clear_metrics()
        Trainer(strategy="xla_native", max_steps=8, log_every_n_steps=2, default_root_dir=str(tmp_path), logger=False,
                enable_checkpointing=False, enable_progress_bar=False, **kwargs).fit(Regressor(), make_loader(64, 8))
        _xla.wait_device_ops()
        return _xla.execute_count(), _xla.transfer_from_device_count()

    off = counts(enable_xla_health=False, hang_timeout=None, enable_goodput=False)
    on = counts(enable_xla_health=True, hang_timeout="auto", enable_goodput=True)
    assert on == off


# ---- goodput accounting --------------------------------------------------------------------------
def account(folder):
    with open(os.path.join(folder, "goodput.json")) as f:
        return json.load(f)


def test_goodput_across_a_kill_and_a_graceful_stop_counts_restarts_and_the_steps_lost(tmp_path):
    # Run 1 saves every 4 steps, logs every step (writing its account each time), and is killed
    # (SIGKILL) after step 7: its last account says step 7; the newest checkpoint is step 4.
    killed = run_fit(tmp_path, ckpt_every=4, log_every_n_steps=1, kill_at=7, steps=12, goodput_write_every=0)
    assert killed.returncode == -9
    first = account(tmp_path / "version_0")
    assert first["status"] == "running" and first["last_step"] == 7 and first["resumed_from_step"] is None
    # Run 2 resumes from step 4 (3 steps lost) and is stopped by SIGTERM after step 9: it saves there.
    stopped = run_fit(tmp_path, ckpt_every=4, log_every_n_steps=1, term_at=9, steps=12, ckpt_path="last")
    assert stopped.returncode != 0 and "Stopped by SIGTERM" in stopped.stderr
    second = account(tmp_path / "version_1")
    assert second["status"] == "interrupted" and second["resumed_from_step"] == 4 and second["last_step"] == 9
    assert second["seconds"]["checkpointing"] > 0  # the saves at step 8 and at the stop
    # Run 3 resumes from the stop's checkpoint at step 9 (nothing lost) and finishes.
    done = run_fit(tmp_path, ckpt_every=4, log_every_n_steps=1, steps=12, ckpt_path="last")
    assert done.returncode == 0, done.stderr[-3000:]
    third = account(tmp_path / "version_2")
    assert third["status"] == "finished" and third["resumed_from_step"] == 9 and third["last_step"] == 12
    seconds = third["seconds"]
    assert seconds["startup"] > 0 and seconds["training"] > 0 and set(seconds) == {
        "startup", "compiling", "data", "checkpointing", "validating", "training"}
    assert abs(sum(seconds.values()) - (third["ended_at"] - third["process_started_at"])) < 0.5
    assert "goodput: this run" in done.stdout
    assert "goodput: 3 runs under this root (2 resumed)" in done.stdout and "3 steps lost to preemption" in done.stdout


def test_time_spent_waiting_for_data_is_counted_as_such(tmp_path):
    import time as clock

    from torch.utils.data import DataLoader, Dataset

    from xtrainer.goodput import Goodput

    class SlowAfterAWhile(Dataset):
        """The first 8 batches load at once; each of the next 8 takes 8 x 30 ms."""

        def __init__(self):
            self.data = make_loader(128, 1).dataset

        def __len__(self):
            return len(self.data)

        def __getitem__(self, i):
            if i >= 64:
                clock.sleep(0.03)
            return self.data[i]

    account_of = Goodput()
    Trainer(max_steps=16, default_root_dir=str(tmp_path), logger=False, enable_checkpointing=False,
            enable_progress_bar=False, callbacks=[account_of]).fit(Regressor(), DataLoader(SlowAfterAWhile(),
                                                                                      batch_size=8))
    seconds = account_of.record["seconds"]
    # The slow half (1.9 s of loading, part of it read ahead while the first step compiled) is
    # waited for between steps, which take far less.
    assert seconds["data"] >= 0.5 and seconds["data"] > 3 * seconds["training"]


@pytest.mark.parametrize("write_every", [0, 3600])
def test_the_account_is_written_at_logging_steps_once_every_write_every_seconds(tmp_path, write_every):
    from xtrainer.goodput import Goodput

    class Versions(Callback):
        """The time of goodput.json's last write, after each step."""

        def __init__(self):
            self.written = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.written.append(account(trainer.log_dir)["updated_at"])

    versions = Versions()
    trainer = Trainer(max_steps=6, log_every_n_steps=1, default_root_dir=str(tmp_path), logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      callbacks=[Goodput(write_every=write_every), versions])
    trainer.fit(Regressor(), make_loader(64, 8))
    # Written at the first logging step; then at each one, or not again before the end.
    assert len(set(versions.written)) == (6 if write_every == 0 else 1)
    assert account(tmp_path / "version_0")["status"] == "finished"
    with pytest.raises(ValueError, match="write_every"):
        Goodput(write_every=-1)


def test_compilations_after_the_first_step_are_counted_as_compiling_and_the_account_adds_up(tmp_path):
    from xtrainer import goodput
    from xtrainer.goodput import Goodput

    class CompileClock(Callback):
        def on_fit_start(self, trainer, module):
            self.at_start = trainer.strategy.runtime.compile_seconds()

        def on_fit_end(self, trainer, module):
            self.at_end = trainer.strategy.runtime.compile_seconds()

    account_of, clock = Goodput(), CompileClock()
    since = goodput._last_fit_ended_at  # where this fit's startup is counted from (0: the process's start)
    # 20 samples in batches of 8: the last batch of 4 compiles graphs of its own in the first
    # epoch; the first validation compiles the evaluation graphs.
    Trainer(strategy="xla_native", max_epochs=2, default_root_dir=str(tmp_path), logger=False,
            enable_checkpointing=False, enable_progress_bar=False, num_sanity_val_steps=0, log_every_n_steps=1,
            callbacks=[clock, account_of]).fit(Regressor(), make_loader(20, 8), make_loader(8, 8))
    record = account_of.record
    seconds = record["seconds"]
    compiled = clock.at_end - clock.at_start
    assert seconds["compiling"] > 0 and seconds["validating"] > 0 and seconds["training"] > 0
    assert record["startup_compiling"] + seconds["compiling"] == pytest.approx(compiled, abs=1e-6)
    began = since or record["process_started_at"]
    assert sum(seconds.values()) == pytest.approx(record["ended_at"] - began, abs=0.01)  # every second, once


# ---- xtrainer doctor -------------------------------------------------------------------------------
def test_doctor_checks_each_way_of_starting_replicas_quickly_and_passes_on_a_healthy_machine(tmp_path):
    # The default plan, as a user runs it: one check per kind of launcher, each strategy at
    # device counts it accepts (native at one device only).
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": os.path.dirname(HERE)}
    report = tmp_path / "report.md"
    done = subprocess.run([sys.executable, "-m", "xtrainer.cli", "doctor", "--output", str(report)],
                          capture_output=True, text=True, timeout=subprocess_timeout(120), env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = report.read_text()
    assert text in done.stdout
    assert "torch_xla 2.9" in text and "runtime: PJRT device CPU" in text and "flags: PJRT_DEVICE=CPU" in text
    listed = re.search(r"^- checks, quick: .*\(--full checks every strategy\): (.*)$", text, re.M).group(1)
    planned = [tuple(check.split(" on ")) for check in listed.split(", ")]
    assert set(planned) == {("xla_native", "2"), ("xla_spmd", "2"), ("native_ddp", "2"), ("xla_native", "1"),
                            ("native", "1")}
    rows = [line.strip("| ").split(" | ") for line in text.splitlines()
            if re.match(r"\| \w+ \| \d+ \|", line)]
    assert [(row[0], row[1]) for row in rows] == planned
    assert all(row[2] == "ok" for row in rows), text
    # XLA's replicas started before this process's runtime; XLA's backward here before the CPU's.
    at = planned.index
    assert at(("xla_native", "2")) < at(("xla_native", "1")) > at(("xla_spmd", "2"))
    assert at(("xla_native", "1")) < at(("native", "1"))
    by_check = {(row[0], row[1]): row for row in rows}
    assert by_check["xla_native", "2"][3:7] == ["yes (2 replicas)", "yes", "yes", "yes (from step 16 to 24)"]
    assert by_check["native_ddp", "2"][3] == "yes (2 replicas)" and by_check["xla_spmd", "2"][3] == "yes (one program)"
    for one in (by_check["xla_native", "1"], by_check["native", "1"]):
        assert one[3:7] == ["yes (one replica)", "yes", "yes", "yes (from step 32 to 48)"]
    assert float(by_check["xla_native", "1"][10]) > 0  # model FLOP/s, counted from the step
    assert "All checks passed (5 of 5)." in text and "FAILED" not in text
    assert "xtrainer doctor: checking " in done.stderr and "(5/5)" in done.stderr


def test_doctor_plans_each_strategy_at_counts_it_accepts_and_refuses_others_in_one_line():
    from xtrainer.launch import doctor
    from xtrainer.strategies import STRATEGIES

    with pytest.raises(SystemExit, match="unknown strategy 'xla_dpp'"):
        doctor.plan("xla_dpp:2", None)
    with pytest.raises(SystemExit, match="'native' runs on one device; ask for native:1"):
        doctor.plan("native:2", None)
    assert doctor.plan("native,xla_ddp", 4) == [("xla_ddp", 4), ("native", 1)]
    full = doctor.plan("", 4, full=True)
    # every strategy that needs no service started first (native_ft needs a lighthouse)
    assert {name for name, _ in full} == {n for n, c in STRATEGIES.items() if c.runs_standalone} \
        and ("xla_fsdpv2", 4) in full
    assert full.index(("xla_native", 1)) < full.index(("native", 1))  # in this process, XLA's first
    quick = doctor.plan("", 4)
    assert set(quick) < set(full) and ("native", 1) in quick
    for plan in (quick, full, doctor.plan("", 1, full=True)):
        assert ("native", 1) in plan and not [count for name, count in plan if name == "native" and count > 1]
    # Something wrong on the machine before any check: exit 1 and one line saying what to do.
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": os.path.dirname(HERE), "XTRAINER_PREEMPTION_SYNC": "maybe"}
    done = subprocess.run([sys.executable, "-m", "xtrainer.cli", "doctor"], capture_output=True, text=True,
                          timeout=subprocess_timeout(30), env=env)
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        "xtrainer doctor: strategy 'xla_spmd': XTRAINER_PREEMPTION_SYNC='maybe': use 1 (stop on XLA's preemption "
        "sync) or 0 (don't)."], done.stderr


# ---- asynchronous checkpoints ---------------------------------------------------------------------
def test_background_writes_give_the_same_checkpoints_as_synchronous_ones(tmp_path):
    import torch

    from xtrainer.callbacks import ModelCheckpoint
    from xtrainer.checkpoint import load_checkpoint

    def fit(folder, background):
        saver = ModelCheckpoint(every_n_train_steps=2, save_top_k=2, monitor="train_loss_step", save_last=True)
        model = Regressor()
        Trainer(max_steps=12, default_root_dir=str(tmp_path / folder), logger=False, enable_progress_bar=False,
                log_every_n_steps=2, async_checkpointing=background, callbacks=[saver]).fit(model, make_loader(64, 8))
        return saver, model

    sync_saver, sync_model = fit("sync", False)
    async_saver, async_model = fit("async", True)
    names = lambda saver: sorted(os.listdir(saver.dirpath))  # noqa: E731
    assert names(async_saver) == names(sync_saver) and len(names(sync_saver)) == 3  # top 2 and last
    for name in names(sync_saver):
        a = load_checkpoint(os.path.join(async_saver.dirpath, name))
        s = load_checkpoint(os.path.join(sync_saver.dirpath, name))
        assert a["loops"] == s["loops"] and a["optimizer_states"][0]["param_groups"] == s["optimizer_states"][0][
            "param_groups"]
        saver_state = lambda c: {k: v for k, v in next(iter(c["callbacks"].values())).items()  # noqa: E731
                                 if "path" not in k and k not in ("best_k_models", "kept", "last_target")}
        assert str(saver_state(a)) == str(saver_state(s))  # the saver's bookkeeping as it was at that step
        assert all(torch.equal(a["state_dict"][k], v) for k, v in s["state_dict"].items())
    assert all(torch.equal(a, b) for a, b in zip(async_model.state_dict().values(), sync_model.state_dict().values()))


def test_a_kill_during_a_background_write_resumes_from_the_previous_checkpoint_bitwise(tmp_path):
    import torch

    # Slow writes (50 ms per chunk): the loop goes on while step 8's checkpoint is written; the
    # process is killed in the middle of that write.
    killed = run_fit(tmp_path / "runs", steps=16, ckpt_every=4, async_checkpointing=True, die_writing="step=8",
                     slow_write_s=0.05)
    assert killed.returncode == -9, killed.stderr[-3000:]
    reached = int(re.search(r"loop at step (\d+)", killed.stdout).group(1))
    assert reached > 8  # the loop did not wait for the write
    resumed = run_fit(tmp_path / "runs", steps=16, ckpt_every=4, async_checkpointing=True, ckpt_path="last",
                      out=str(tmp_path / "resumed.pt"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step=4.ckpt" in resumed.stdout.split("resuming from", 1)[1].splitlines()[0]  # the previous one
    straight = run_fit(tmp_path / "straight", steps=16, out=str(tmp_path / "straight.pt"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    a, b = torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "straight.pt")
    assert all(torch.equal(a[k], b[k]) for k in b)
