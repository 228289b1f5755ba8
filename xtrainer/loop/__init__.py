"""The loop: what runs a fit, step by step, and what it keeps.

- ``fit.py``: the epoch loop and the training step, in the order they run.
- ``state.py``: ``LoopState``, where a fit is (step, epoch, batches in the epoch...).
- ``optimization.py``: the optimizers of a run and how they step (clipping, schedulers, manual
  optimization); ``optimizers.py``: what ``configure_optimizers`` may return, parsed, and the
  schedulers' stepping.
- ``evaluation.py``: validation, test, predict and the sanity check.
- ``publishing.py``: the one place logged values reach the host, and the epoch ends.
- ``checkpoints.py``: what a fit saves (the checkpoint's dict) and how it continues from one;
  the files themselves are ``xtrainer.checkpoint``'s.
"""
