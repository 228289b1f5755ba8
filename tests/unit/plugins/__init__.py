"""The unit tests of ``xtrainer/plugins/``: ``test_<module>.py`` for ``<module>.py``."""
