"""``lightning.pytorch.utilities.exceptions``' name for a configuration error, for projects that
raise or catch it. The Trainer's own configuration errors are ``ValueError``s; this is one too, so
``except ValueError`` catches both."""

from __future__ import annotations


class MisconfigurationException(ValueError):
    """A setting that cannot work (Lightning's ``MisconfigurationException``)."""


__all__ = ["MisconfigurationException"]
