"""``xtrainer/plugins/environments.py`` on its own: its unit tests, nothing trained."""

from __future__ import annotations

import signal

import pytest

from unit.clusters.test_slurm import environ  # noqa: F401  (a fixture: os.environ without SLURM's or torch's vars)
from xtrainer import Trainer
from xtrainer.clusters import SLURMEnvironment


def test_requeue_options_and_plugins(environ):
    from xtrainer.plugins.environments import SLURMEnvironment as Lightnings

    assert Lightnings is SLURMEnvironment
    env = SLURMEnvironment()
    assert env.auto_requeue and env.requeue_signal == signal.SIGUSR1 and env.stop_signals() == (signal.SIGUSR1,)
    assert SLURMEnvironment(auto_requeue=False).stop_signals() == ()
    assert SLURMEnvironment(requeue_signal=signal.SIGUSR2).stop_signals() == (signal.SIGUSR2,)
    with pytest.raises(ValueError, match="cannot be handled"):
        SLURMEnvironment(requeue_signal=signal.SIGKILL)
    given = SLURMEnvironment(auto_requeue=True, requeue_signal=signal.SIGUSR1)
    assert Trainer(plugins=[given], logger=False).cluster_environment is given  # outside a job: changes nothing
    assert "RANK" not in environ
    with pytest.raises(ValueError, match="2 cluster environments given"):
        Trainer(plugins=[SLURMEnvironment(), SLURMEnvironment()], logger=False)
    with pytest.raises(ValueError, match="plugins=...: Lightning's plugins"):
        Trainer(plugins=[given, object()], logger=False)
    # a requeued job continues from last; a first run as the user asked
    environ["SLURM_RESTART_COUNT"] = "0"
    assert env.fit_ckpt_path(None) is None and env.fit_ckpt_path("x.ckpt") == "x.ckpt"
    environ["SLURM_RESTART_COUNT"] = "1"
    assert env.fit_ckpt_path(None) == "last" and env.fit_ckpt_path("x.ckpt") == "last"
    assert SLURMEnvironment(auto_requeue=False).fit_ckpt_path(None) is None
