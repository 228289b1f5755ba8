"""``python -m xtrainer ...``: the ``xtrainer`` command (``xtrainer/launch/cli.py``)."""

import sys

from xtrainer.launch.cli import main

sys.exit(main())
