"""Unit tests: what one module does, nothing trained; the folders mirror ``xtrainer/``."""
