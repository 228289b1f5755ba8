"""The unit tests of ``xtrainer/strategies/``: ``test_<module>.py`` for ``<module>.py``."""
