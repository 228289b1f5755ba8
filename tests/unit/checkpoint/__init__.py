"""The unit tests of ``xtrainer/checkpoint/``: ``test_<module>.py`` for ``<module>.py``."""
