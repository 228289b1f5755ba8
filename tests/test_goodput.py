"""Goodput on real pods: the persistent compilation cache, the hang watchdog, MFU, goodput
accounting and ``xtrainer doctor``, on the CPU runtime, in real processes."""

import json
import os
import re
import subprocess
import sys

import pytest

from xtrainer import compile_cache

HERE = os.path.dirname(os.path.abspath(__file__))


def run_fit(root, timeout=240, **options):
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE)])}
    return subprocess.run([sys.executable, os.path.join(HERE, "goodput_run.py"), str(root), json.dumps(options)],
                          capture_output=True, text=True, timeout=timeout, env=env)


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


def test_cache_folders_per_process(tmp_path):
    assert compile_cache.process_folder("/c", 1, 3, 0) == "/c/rank_3"
    assert compile_cache.process_folder("/c", 4, 0, 1) == "/c/process_1"
    assert compile_cache.folder_for(False, str(tmp_path)) is None
    assert compile_cache.folder_for(True, str(tmp_path)) == str(tmp_path / "xla_cache")
    assert compile_cache.folder_for(str(tmp_path / "x"), "/elsewhere") == str(tmp_path / "x")
