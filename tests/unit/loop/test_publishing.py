"""The names logged values are published under (``xtrainer/loop/publishing.py``), as Lightning's."""

import torch


def test_the_automatic_learning_rate_names_keep_two_optimizers_of_one_class_apart():
    """A GAN's two Adams: ``lr-Adam/pg0`` and ``lr-Adam-1/pg0`` (one name each, as Lightning's
    LearningRateMonitor keeps them apart), every group of each."""
    from xtrainer.loop.publishing import automatic_lr_names

    g, d = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    generator = torch.optim.Adam(g.parameters(), lr=1e-3)
    discriminator = torch.optim.Adam([{"params": [d.weight]}, {"params": [d.bias], "lr": 1e-2}], lr=5e-4)
    names = {name: group["lr"] for name, group in automatic_lr_names([generator, discriminator])}
    assert names == {"lr-Adam/pg0": 1e-3, "lr-Adam-1/pg0": 5e-4, "lr-Adam-1/pg1": 1e-2}
