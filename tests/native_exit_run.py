"""``native_run.py`` (same arguments), and each process writes the code it exits with to
``ROOT/rank-R.exit``: under torchrun the launcher, not the test, sees the workers' exit codes."""

from __future__ import annotations

import os
import sys

import native_run


def main() -> None:
    root = sys.argv[sys.argv.index("--root") + 1]
    code: int | str | None = 0
    try:
        native_run.main()
    except SystemExit as err:
        code = err.code
        raise
    except BaseException as err:  # an error, not an exit: named so that a test sees it
        code = type(err).__name__
        raise
    finally:
        with open(os.path.join(root, f"rank-{os.environ.get('RANK', '0')}.exit"), "w") as f:
            f.write(str(code if code is not None else 0))


if __name__ == "__main__":
    main()
