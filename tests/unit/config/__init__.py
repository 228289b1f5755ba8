"""The unit tests of ``xtrainer/config/``: ``test_<module>.py`` for ``<module>.py``."""
