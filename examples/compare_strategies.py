"""Train the digits example with every strategy and plot their validation curves side by side.

    python examples/compare_strategies.py                      # writes docs/compare_strategies.png
    python examples/compare_strategies.py trainer.devices=2    # any override of examples/digits.yaml

Each run logs to TensorBoard as usual (``runs/compare/<strategy>/version_N``); this script reads
the event files back with TensorBoard's own reader and draws validation accuracy and loss over
optimizer steps, one curve per strategy.
"""

from __future__ import annotations

import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no window
import matplotlib.pyplot as plt  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def curves(log_dir: str, tags: tuple[str, ...]) -> dict[str, tuple[list[int], list[float]]]:
    events = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    events.Reload()
    return {tag: ([e.step for e in events.Scalars(tag)], [e.value for e in events.Scalars(tag)]) for tag in tags}


def main(argv: list[str], out: str = os.path.join(ROOT, "docs", "compare_strategies.png")) -> str:
    sys.path.insert(0, ROOT)
    from examples.digits import CONFIG
    from xtrainer.cli import run_stage
    from xtrainer.config import load
    from xtrainer.strategies import STRATEGIES  # every registered strategy

    runs = {}
    for strategy in STRATEGIES:
        config = load(["--config", CONFIG, f"trainer.strategy={strategy}", "trainer.enable_progress_bar=false",
                       f"trainer.default_root_dir={os.path.join('runs', 'compare', strategy)}", *argv])
        trainer, _ = run_stage("fit", config)
        runs[strategy] = curves(trainer.log_dir, ("val_acc", "val_loss"))
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    styles = {"xla_native": ("-", "o", 11), "xla_ddp": ("--", "s", 8), "xla_fsdp": (":", "^", 6),
              "xla_spmd": ("-.", "D", 4), "xla_fsdpv2": (":", "x", 4)}
    for strategy, data in runs.items():
        line, marker, size = styles.get(strategy, ("-", "o", 5))
        for ax, tag in zip(axes, ("val_acc", "val_loss")):
            steps, values = data[tag]
            ax.plot(steps, values, linestyle=line, marker=marker, markersize=size, label=strategy)
    for ax, title in zip(axes, ("validation accuracy", "validation loss")):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend()
    figure.suptitle("digits MLP on the XLA CPU runtime, one curve per strategy (where they coincide, the "
                    "strategies computed the same numbers)", fontsize=10)
    figure.tight_layout()
    os.makedirs(os.path.dirname(out), exist_ok=True)
    figure.savefig(out, dpi=110)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
