"""Secrets kept out of what a run writes about itself.

A configuration may hold a secret, typically through ``${oc.env:WANDB_API_KEY}``; the run gets
the real value, but the files that describe the run (its ``config.yaml``, the loggers'
``hparams.yaml`` and TensorBoard's HPARAMS view) show ``"***"`` instead:

* every string under a key whose name looks secret (it contains ``token``, ``secret``,
  ``password``, ``passwd``, ``api_key``/``apikey``, ``credential``, ``private_key``,
  ``access_key`` or ``auth``; ``tokens``, ``tokenizer`` and ``author`` are not secret), at any
  depth, including flat keys such as ``model.api_token``;
* in every other string, the value of each environment variable whose name looks secret (values
  of at least ``MIN_SECRET_LENGTH`` characters), wherever it appears (a URL that embeds a
  password is written with ``***`` in its place).

Numbers, booleans and ``None`` are never secrets and are written as they are. Checkpoints keep the
module's hyperparameters as given (``load_from_checkpoint`` rebuilds the module from them).
``redact`` is the one function that does this; ``xtrainer.config.to_yaml`` and
``Trainer.hyperparameters`` (what every logger receives) call it.
"""

from __future__ import annotations

import os
import re
from argparse import Namespace
from collections.abc import Mapping
from typing import Any

REDACTED = "***"
#: Shorter values of secret-looking environment variables are not looked for in other strings
#: (``AUTH_MODE=1`` would otherwise turn every "1" into "***").
MIN_SECRET_LENGTH = 6

_SECRET_NAME = re.compile(r"token(?!s|i[sz])|secret|passw(?:or)?d|api_?key|credential|private_?key|access_?key|"
                          r"auth(?!or(?!i[sz]))", re.IGNORECASE)


def looks_secret(name: Any) -> bool:
    """Whether a key or an environment variable named ``name`` holds a secret, by its name."""
    return isinstance(name, str) and _SECRET_NAME.search(name.replace("-", "_")) is not None


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """The values of the environment variables whose names look secret, longest first."""
    environ = os.environ if environ is None else environ
    found = {v for k, v in environ.items() if looks_secret(k) and isinstance(v, str) and len(v) >= MIN_SECRET_LENGTH}
    return sorted(found, key=len, reverse=True)


def redact(value: Any, environ: Mapping[str, str] | None = None) -> Any:
    """``value`` (mappings, lists and tuples walked; mappings come back as dicts) with the secrets
    described in the module's docstring replaced by ``"***"``. Anything else is returned as is."""
    return _redact(value, False, secret_values(environ))


def _redact(value: Any, secret: bool, env_secrets: list[str]) -> Any:
    if isinstance(value, Namespace):
        value = vars(value)
    if isinstance(value, Mapping):
        return {k: _redact(v, secret or looks_secret(k), env_secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_redact(v, secret, env_secrets) for v in value]
        return tuple(items) if type(value) is tuple else items
    if isinstance(value, str):
        if secret and value:
            return REDACTED
        for known in env_secrets:
            if known in value:
                value = value.replace(known, REDACTED)
        return value
    return value
