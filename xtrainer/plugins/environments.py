"""Lightning's ``lightning.pytorch.plugins.environments``: ``SLURMEnvironment`` (``xtrainer/clusters/``)."""

from xtrainer.clusters import ClusterEnvironment, SLURMEnvironment

__all__ = ["ClusterEnvironment", "SLURMEnvironment"]
