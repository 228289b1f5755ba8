"""The loop: what runs a fit, step by step, and what it keeps.

- ``run.py``: ``Run``, what one replica's run owns (the wrapped module, the optimizers, the
  logged results, the data); the ``Trainer`` is a façade over it and ``LoopState``.
- ``stages.py``: a stage, both halves: in the calling process (its data, the run folder, the
  replicas through the strategy's launcher, rank 0's results brought home) and in each replica
  (from its environment to its teardown).
- ``fit.py``: the epoch loop and the training step, in the order they run.
- ``state.py``: ``LoopState``, where a fit is (step, epoch, batches in the epoch...); only the
  loop writes it.
- ``optimization.py``: the optimizers of a run and how they step (clipping, schedulers, manual
  optimization); ``optimizers.py``: what ``configure_optimizers`` may return, parsed, and the
  schedulers' stepping.
- ``evaluation.py``: validation, test, predict and the sanity check.
- ``publishing.py``: the one place logged values reach the host, and the epoch ends;
  ``nonfinite.py``: the watch for a NaN or infinite training loss; ``agreement.py``: the
  replicas' agreement on a stop and a time-based validation.
- ``steps.py``: what the module must have, and the dispatcher that calls its ``*_step`` methods
  inside the strategy's wrappers; the training loss.
- ``results.py``: values logged with ``self.log``, accumulated on the device;
  ``metric_values.py``: ``callback_metrics`` as Lightning's tensors; ``metric_sync.py``: an
  explicit ``metric.compute()`` synced through the strategy.
- ``loaders.py``: where a run's data comes from (given loaders, a data module, the module's
  hooks), ``limit_*_batches``, reloading.
- ``checkpoints.py``: what a fit saves (the checkpoint's dict) and how it continues from one;
  the files themselves are ``xtrainer.checkpoint``'s.
"""
