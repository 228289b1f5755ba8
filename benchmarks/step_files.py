"""Which of xtrainer's files one optimizer step crosses, traced from a real fit:

    python benchmarks/step_files.py                 # native strategy, the Trainer's defaults
    python benchmarks/step_files.py --strategy xla_native -v
    python benchmarks/step_files.py --bare          # no default callbacks: the loop's own files

Runs a tiny fit (a linear regressor, 8 batches, default callbacks) under ``sys.setprofile`` and
takes one steady-state batch (the 6th): from the end of the batch before (the graph cut
returning) to its own graph cut, every Python function of the package that runs, at any depth
(the data fetch, the hooks, forward, backward, the optimizer step, the cut).

- ``per batch``: the files of those functions;
- ``entry to cut``: those, with the files on the call stack at the cut itself (from
  ``Trainer.fit`` down: the launcher, the stage, the replica's run, the loop).

Host-only counting (no device work is measured); the figure is the structure's, not a time.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def trace(strategy: str, batch: int = 6, bare: bool = False) -> tuple[set[str], set[str], list[str]]:
    """``(per_batch_files, entry_to_cut_files, functions)`` of the ``batch``-th training batch."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import xtrainer
    from xtrainer import Trainer, XModule

    package = os.path.dirname(os.path.abspath(xtrainer.__file__)) + os.sep

    class Regressor(XModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    state = {"cuts": 0, "on": False, "done": False}
    files: set[str] = set()
    stack_files: set[str] = set()
    functions: list[str] = []

    def is_cut(frame) -> bool:
        # the loop's graph cut: ``strategy.runtime.sync()`` called from loop/fit.py's step
        caller = frame.f_back
        return (frame.f_code.co_name == "sync" and frame.f_code.co_filename.startswith(package + "runtimes")
                and caller is not None and caller.f_code.co_filename == package + os.path.join("loop", "fit.py"))

    def profile(frame, event, arg):
        if state["done"] or event not in ("call", "return"):
            return
        path = frame.f_code.co_filename
        if not path.startswith(package):
            return
        if event == "call" and state["on"]:
            rel = os.path.relpath(path, package)
            files.add(rel)
            name = f"{rel}:{frame.f_code.co_name}"
            if name not in functions:
                functions.append(name)
            if is_cut(frame):
                walk = frame
                while walk is not None:
                    if walk.f_code.co_filename.startswith(package):
                        stack_files.add(os.path.relpath(walk.f_code.co_filename, package))
                    walk = walk.f_back
        if event == "return" and is_cut(frame):
            state["cuts"] += 1
            if state["on"]:
                state["on"], state["done"] = False, True
            elif state["cuts"] == batch - 1:
                state["on"] = True

    with tempfile.TemporaryDirectory() as root:
        off = dict(enable_checkpointing=False, enable_progress_bar=False, enable_xla_health=False,
                   enable_goodput=False, hang_timeout=None, enable_model_summary=False, logger=False) if bare else {}
        trainer = Trainer(strategy=strategy, max_epochs=1, default_root_dir=root, log_every_n_steps=1000,
                          limit_train_batches=8, **off)
        sys.setprofile(profile)
        try:
            trainer.fit(Regressor(), DataLoader(data, batch_size=8))
        finally:
            sys.setprofile(None)
    return files, files | stack_files, functions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="native")
    parser.add_argument("--bare", action="store_true", help="without the default callbacks")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    per_batch, entry, functions = trace(args.strategy, bare=args.bare)
    print(f"{args.strategy}{' (no default callbacks)' if args.bare else ''}: entry to cut {len(entry)} files, per batch {len(per_batch)} files "
          f"({len(functions)} functions per batch)")
    if args.verbose:
        print("  per batch: " + ", ".join(sorted(per_batch)))
        print("  entry to cut, besides: " + ", ".join(sorted(entry - per_batch)))
        for name in functions:
            print("    " + name)


if __name__ == "__main__":
    main()
