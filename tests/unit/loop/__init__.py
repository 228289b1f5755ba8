"""The unit tests of ``xtrainer/loop/``: ``test_<module>.py`` for ``<module>.py``."""
