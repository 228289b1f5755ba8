"""How a run starts and ends as a process: the ``xtrainer`` command (``cli.py``), signals and
graceful stops (``interrupts.py``), the hang watchdog (``watchdog.py``) and ``xtrainer doctor``
(``doctor.py``). A stage itself, in the calling process and in each replica, is
``loop/stages.py``; how the replicas start is the strategy's launcher
(``strategies/launchers/__init__.py``).

Nothing is imported here: ``xtrainer --help`` stays fast."""
