"""A module that runs itself inside its dataset: reinforcement learning as Lightning's examples write it.

Lightning's PPO example trains on an ``IterableDataset`` whose generator plays the environment
with the policy on ``self.device`` and reads a value to the host (``.item()``, ``.cpu()``) at
every environment step. On XLA each read runs a graph; read in a background thread those graphs
differed at nearly every step (the random seed's chain and the unread ops grew between the
training step's cuts) and compiled anew. Here the fit's compilations must stop growing after the
first epoch, at one device and with two replicas, and ``XlaHealth`` must count the ones the data
loading compiled.
"""

import json
import os
import random

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from xtrainer import Trainer, _xla
from xtrainer import XModule as LightningModule
from xtrainer.callbacks import Callback
from xtrainer.callbacks.health import XlaHealth

SIZE = 7  # sizes of this file's own, so that no other test's graphs are in the process's cache
HIDDEN = 11
BATCH = 4


class Corridor:
    """A synthetic environment: a position in a corridor, step left or right, rewarded at the end."""

    def __init__(self, seed: int = 0) -> None:
        self.random = random.Random(seed)
        self.reset()

    def reset(self) -> torch.Tensor:
        self.position = self.random.randrange(SIZE - 1)
        return self.observation()

    def observation(self) -> torch.Tensor:
        seen = torch.zeros(SIZE)
        seen[self.position] = 1.0
        return seen

    def step(self, action: int) -> tuple[torch.Tensor, float, bool]:
        self.position = max(0, min(SIZE - 1, self.position + (1 if action == 1 else -1)))
        done = self.position == SIZE - 1
        return self.observation(), (1.0 if done else -0.1), done


class ExperienceSource(IterableDataset):
    """Lightning's ``ExperienceSourceDataset``: the module's generator is the dataset."""

    def __init__(self, generate):
        self.generate = generate

    def __iter__(self):
        return self.generate()


class PolicyGradient(LightningModule):
    """Lightning's PPO example in small: the generator calls the policy and the critic on
    ``self.device``, samples the action there, reads it (``.cpu()``) and the value (``.item()``)
    at every environment step, and yields device tensors."""

    def __init__(self, steps_per_epoch: int = 8) -> None:
        super().__init__()
        self.steps_per_epoch = steps_per_epoch
        torch.manual_seed(0)
        self.actor = nn.Sequential(nn.Linear(SIZE, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 2))
        self.critic = nn.Sequential(nn.Linear(SIZE, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))
        self.env = Corridor()
        self.state = self.env.reset()

    def generate(self):
        for _ in range(self.steps_per_epoch * BATCH):
            state = self.state.to(device=self.device)
            with torch.no_grad():
                pi = torch.distributions.Categorical(logits=self.actor(state))
                action = pi.sample()
                logp = pi.log_prob(action)
                value = self.critic(state)
            observation, reward, done = self.env.step(int(action.cpu().numpy()))
            advantage = reward - value.item()  # the host read Lightning's example makes each step
            self.state = self.env.reset() if done else observation
            yield state, action, logp, torch.tensor(reward), torch.tensor(advantage)

    def training_step(self, batch, batch_idx):
        state, action, logp_old, reward, advantage = batch
        pi = torch.distributions.Categorical(logits=self.actor(state), validate_args=False)
        ratio = torch.exp(pi.log_prob(action) - logp_old)
        loss = -(torch.clamp(ratio, 0.8, 1.2) * advantage).mean() + (self.critic(state).squeeze(1) - reward).pow(2).mean()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return DataLoader(ExperienceSource(self.generate), batch_size=BATCH)


class Compilations(Callback):
    """Each replica writes ``rank-R.json``: the process's compilations after every step."""

    def __init__(self, folder):
        self.folder, self.after_step = str(folder), []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.after_step.append((_xla.compile_count(), _xla.data_loading_counters()["compiles"]))

    def teardown(self, trainer, module, stage):  # after XlaHealth's on_fit_end, which totals the fit
        health = next(cb for cb in trainer.callbacks if isinstance(cb, XlaHealth))
        with open(os.path.join(self.folder, f"rank-{trainer.global_rank}.json"), "w") as f:
            json.dump({"after_step": self.after_step, "totals": getattr(health, "totals", None),
                       "recompilations": health.recompilations}, f)


def fit(tmp_path, devices=1, epochs=3, steps_per_epoch=8):
    tmp_path.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(strategy="xla_native", devices=devices, max_epochs=epochs, default_root_dir=str(tmp_path),
                      logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      callbacks=[Compilations(tmp_path), XlaHealth(on_recompile="raise")])
    module = PolicyGradient(steps_per_epoch)
    trainer.fit(module)
    with open(tmp_path / "rank-0.json") as f:
        return trainer, module, json.load(f)


def test_a_dataset_playing_its_policy_on_the_device_compiles_a_bounded_number_of_graphs(tmp_path, capsys):
    with pytest.warns(UserWarning, match=r"The training data ran ops on the XLA device .* graph\(s\) compiled there"):
        _, _, eight = fit(tmp_path / "8", epochs=1)
    totals = eight["totals"]
    assert len(eight["after_step"]) == 8
    assert 1 <= totals["data_loading_compilations"] <= 4, totals  # the policy's graphs, counted
    assert totals["compilations"] <= 16, totals  # read in a background thread: 80 for 8 steps
    assert "while loading data" in capsys.readouterr().out  # the summary line says so
    compiled = _xla.compile_count()
    # 24 steps, in one epoch or three, compile no graph that 8 steps did not: the count does not
    # grow with the environment steps (it did: the seed's chain differed at each read).
    for epochs, steps in ((1, 24), (3, 8)):
        trainer, _, record = fit(tmp_path / f"{epochs}x{steps}", epochs=epochs, steps_per_epoch=steps)
        assert trainer.global_step == 24 and len(record["after_step"]) == 24
        assert _xla.compile_count() == compiled, (epochs, steps, record["after_step"])
        assert record["totals"]["data_loading_compilations"] == 0
        assert record["recompilations"] == []  # on_recompile="raise" would have stopped the fit too


@pytest.mark.multi_device
def test_two_replicas_playing_their_policy_compile_a_bounded_number_of_graphs(tmp_path):
    """Each replica plays an environment of its own (an IterableDataset is read whole by each)."""
    _, _, record = fit(tmp_path, devices=2, epochs=3)
    compiled, loading = zip(*record["after_step"])
    assert len(compiled) == 24
    # The data loading compiles its graphs in the first epoch and never again; the steps compile
    # nothing after the first step that follows the first epoch (XlaHealth's warm-up, which
    # with thread replicas compiles one graph each). The loading count is a window on the
    # process's compile counter: a graph the other thread replica compiles for its own first
    # steps while this one loads falls into it (under load, at step 2), so only the warm epoch
    # is held to "never again".
    assert loading[0] > 0 and set(loading[8:]) == {loading[8]} and loading[8] <= loading[0] + 2, loading
    assert compiled[-1] == compiled[8], compiled
    assert record["recompilations"] == []
    # The fit's total is that process-wide window halved (two replicas): each replica's loading
    # compiles up to 4 graphs, and up to 2 of the other's step graphs can fall into its window.
    assert 1 <= record["totals"]["data_loading_compilations"] <= 6, record["totals"]
    with open(tmp_path / "rank-1.json") as f:
        assert len(json.load(f)["after_step"]) == 24


def test_a_dataset_playing_its_policy_draws_the_same_experience_on_every_run(tmp_path):
    """Read between steps, the policy always acts with the weights of the step before: two runs
    train alike (read in a background thread, which weights it saw depended on timing)."""
    _, first, _ = fit(tmp_path / "a", epochs=2)
    _, second, _ = fit(tmp_path / "b", epochs=2)
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name


class Failing(IterableDataset):
    """A stream that runs ops on the device, then fails at its fourth item."""

    def __iter__(self):
        for i in range(8):
            if i == 3:
                raise ValueError("the environment crashed")
            yield torch.ones(SIZE, device=_xla.device()).sum().cpu().reshape(1) * i


def test_an_error_in_a_dataset_read_between_steps_names_the_batch(tmp_path):
    class Module(PolicyGradient):
        def training_step(self, batch, batch_idx):
            return self.critic(batch.new_ones(1, SIZE)).sum() * batch.sum()

        def train_dataloader(self):
            return DataLoader(Failing(), batch_size=1)

    trainer = Trainer(strategy="xla_native", max_epochs=1, default_root_dir=str(tmp_path), logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match="the environment crashed") as raised:
        trainer.fit(Module())
    assert "(raised while loading batch index 3 of DataLoader over Failing; the batches before it were used)" in \
        raised.value.__notes__
    assert trainer.global_step == 3
