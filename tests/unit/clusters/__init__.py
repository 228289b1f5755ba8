"""The unit tests of ``xtrainer/clusters/``: ``test_<module>.py`` for ``<module>.py``."""
