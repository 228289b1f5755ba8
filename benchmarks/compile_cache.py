"""Restart to first step, with and without the persistent compilation cache (CPU runtime).

    python benchmarks/compile_cache.py [--repeats 2] [--layers 8]

One run trains a few steps, writes a checkpoint and fills the cache; then resumed runs
(``ckpt_path="last"``), each a fresh process as in a restart loop, are timed from the moment the
process is started to the end of its first training step (the step's execution waited for, in
the benchmark's callback only), with the cache off and on. Printed as a Markdown table for
``benchmarks/RESULTS.md``, with the cache's own account of each run (hits, unloadable entries).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def child(root: str, cache: str, layers: int, steps: int) -> None:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from xtrainer import Trainer, XModule, _xla
    from xtrainer.callbacks import Callback

    class Deep(XModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(64, 64), nn.GELU())],
                                     nn.Linear(64, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class FirstStep(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if not hasattr(self, "done"):
                _xla.wait_device_ops()  # host sync, benchmark only: the first step has finished
                self.done = time.time()
                print(json.dumps({"first_step_at": self.done}), flush=True)

    data = TensorDataset(torch.randn(256, 64), torch.randn(256, 1))
    setting = {"off": False, "on": True}[cache]
    trainer = Trainer(default_root_dir=root, max_steps=steps, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, compilation_cache=setting, callbacks=[FirstStep()],
                      num_sanity_val_steps=0)
    trainer.fit(Deep(), DataLoader(data, batch_size=32), ckpt_path="last")


def timed(root: str, cache: str, layers: int, steps: int) -> tuple[float, str]:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": ROOT}
    start = time.time()
    out = subprocess.run([sys.executable, __file__, "--child", root, cache, str(layers), str(steps)],
                         capture_output=True, text=True, env=env, check=True).stdout
    first = next(json.loads(line)["first_step_at"] for line in out.splitlines() if line.startswith("{"))
    cache_line = next((line for line in out.splitlines() if "compilation cache" in line), "")
    return first - start, cache_line.removeprefix("fit: ")


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        timed(root, "on", args.layers, 4)  # the run that is restarted: checkpoint and cache written
        rows, steps = [], 4
        for repeat in range(args.repeats):
            for cache in ("off", "on"):
                steps += 4  # every restart trains a few steps more
                seconds, note = timed(root, cache, args.layers, steps)
                rows.append((cache, repeat, seconds, note))
    print("| cache | restart | process start to first finished step | the cache's account |")
    print("| --- | ---: | ---: | --- |")
    for cache, repeat, seconds, note in rows:
        print(f"| {cache} | {repeat + 1} | {seconds:.1f} s | {note.split(': ', 1)[-1] if cache == 'on' else '-'} |")


if __name__ == "__main__":
    main()
