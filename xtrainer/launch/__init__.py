"""How a run starts and ends as a process: the ``xtrainer`` command (``cli.py``), a stage run from
the calling process (``stages.py``: the data, the run folder, the replicas through the strategy's
launcher, rank 0's results brought home), signals and graceful stops (``interrupts.py``), the
hang watchdog (``watchdog.py``) and ``xtrainer doctor`` (``doctor.py``). How the replicas
themselves start is the strategy's launcher (``strategies/launchers/__init__.py``).

Nothing is imported here: ``xtrainer --help`` stays fast."""
