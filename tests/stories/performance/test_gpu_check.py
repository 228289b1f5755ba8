"""``./dev gpu-check --tiny``: the GPU check's benchmark (``benchmarks/gpu_check.py``) in its tiny
configuration on the CPU, through ``./dev`` as on a GPU machine, with this test's Python. Every
contender gets a row: measured where its framework imports here, "not installed" where not
(Lightning is not installed in the test environments). The tests of the check,
``tests/stories/native/test_gpu.py``, run in the suite on their own.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import conftest
from conftest import subprocess_timeout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(conftest.__file__)))
CONTENDERS = ["hand", "xtrainer", "lightning", "xtrainer_hf", "hf_trainer"]


def _installed(contender: str) -> bool:
    needs = {"lightning": ["lightning"], "xtrainer_hf": ["transformers"],
             "hf_trainer": ["transformers", "accelerate"]}.get(contender, [])
    return all(importlib.util.find_spec(name) is not None for name in needs)


def test_the_tiny_check_writes_a_row_per_contender(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "GPU_CHECK_PYTHON": sys.executable}
    done = subprocess.run([os.path.join(ROOT, "dev"), "gpu-check", "--tiny", "--skip-tests", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=subprocess_timeout(240))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["accelerator"] == "cpu" and report["config"]["layers"] == 2 and report["config"]["seq"] == 64
    rows = {row["contender"]: row for row in report["rows"]}
    assert list(rows) == CONTENDERS
    for name, row in rows.items():
        if not _installed(name):
            assert row["status"] == "not installed", row
            continue
        assert row["status"] == "ok", row
        assert row["tokens_per_s"] > 0 and math.isfinite(row["final_loss"])
        assert row["mfu"] is None  # the CPU has no peak FLOP/s
        assert row["params"][0] == report["n_params_total"]  # the same GPT-2 shape for every contender
    assert not _installed("lightning") or rows["lightning"]["status"] == "ok"
    # The same model, data and optimizer: xtrainer's loss is the hand loop's.
    assert math.isclose(rows["xtrainer"]["final_loss"], rows["hand"]["final_loss"], rel_tol=1e-3)
    # 6N + 12LTd per token; xtrainer.flops' count on the meta device is close to it.
    assert math.isclose(report["flops_per_token_counted"], report["flops_per_token"], rel_tol=0.05)
    assert report["ratios"]["xtrainer / hand"] == rows["xtrainer"]["tokens_per_s"] / rows["hand"]["tokens_per_s"]
    table = (out / "gpu_check.md").read_text()
    assert "| xtrainer / hand |" in table and "| lightning |" in table
    assert table in done.stdout  # printed too
