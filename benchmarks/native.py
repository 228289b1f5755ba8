"""The native strategies against hand-written PyTorch loops on the CPU: ``benchmarks/run.py
--native`` (its contenders and table live there), under the name this benchmark had before.

    python benchmarks/native.py                  # = python benchmarks/run.py --native
    python benchmarks/native.py --quick --contenders eager native
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    run = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run.py")
    os.execv(sys.executable, [sys.executable, run, "--native", *sys.argv[1:]])
