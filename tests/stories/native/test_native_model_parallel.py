"""``ModelParallelStrategy`` as a Lightning project uses it (Lightning's ``tensor_parallel``
example, shrunk): the module parallelizes itself in ``configure_model()`` over
``self.device_mesh``, a column-wise then a row-wise layer over ``"tensor_parallel"`` and FSDP2 over
``"data_parallel"``, on real gloo processes.

The weights and data are small dyadic numbers in float64, so every sum of a step is exact: a
tensor-parallel layer's partial sums, the data-parallel average and one process's whole-batch sum
give the same bits whatever their order. So 2 x 2 processes are compared with one bitwise, and
so are the resumes at another mesh shape (4 x 1, 1 x 1) of a 2 x 2 checkpoint. This file imports
nothing of torch_xla: it also runs where torch_xla is not installed.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from xtrainer import Trainer, XModule, seed_everything
from xtrainer.callbacks import Callback, ModelCheckpoint
from xtrainer.strategies import ModelParallelStrategy

STEPS = 3  # exact in float64 for this many steps (the tests compare meshes bitwise)
GLOBAL_BATCH = 8


def make_data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(-2, 3, (n, 4), generator=g).double(),
                         torch.randint(-2, 3, (n, 1), generator=g).double())


class FeedForward(nn.Module):
    """Two layers, as a transformer's MLP: ``w1`` split by columns, ``w2`` by rows under TP."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(4, 8).double()
        self.w2 = nn.Linear(8, 4).double()
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Multiples of 1/8 (a step adds a few bits, no more), into whole or sharded parameters."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        for i, p in enumerate(self.parameters()):
            value = (torch.arange(p.numel(), dtype=torch.float64).reshape(p.shape) % 5 - 2 + i) / 8
            p.copy_(distribute_tensor(value, p.device_mesh, p.placements) if isinstance(p, DTensor) else value)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x))).sum(dim=1, keepdim=True)


class TensorParallelModule(XModule):
    """Lightning's way: the layers built in ``__init__``, parallelized in ``configure_model``
    (a no-op under a strategy without a mesh)."""

    def __init__(self, batch_size: int = GLOBAL_BATCH) -> None:
        super().__init__()
        self.model = FeedForward()
        self.batch_size = batch_size
        self.meshes: list[tuple] = []  # what configure_model saw, one entry per call (rank 0's)

    def configure_model(self):
        if self.device_mesh is None:
            return
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        self.meshes.append((tuple(self.device_mesh.shape), tuple(self.device_mesh.mesh_dim_names)))
        parallelize_module(self.model, self.device_mesh["tensor_parallel"],
                           {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = ((self.model(x) - y) ** 2).mean()
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", ((self.model(x) - y) ** 2).mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1 / 16, momentum=0.5)

    def train_dataloader(self):
        # a plain shuffled loader: the strategy shares it out over the data-parallel groups
        return DataLoader(make_data(), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(make_data(16), batch_size=self.batch_size)


class Layout(Callback):
    """Rank 0's view of the parameters once training starts: each one's kind, local shape and mesh."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple] = {}

    def on_train_start(self, trainer, module):
        for name, p in module.named_parameters():
            mesh = getattr(p, "device_mesh", None)
            self.seen[name] = (type(p).__name__, tuple(p.to_local().shape) if mesh is not None else tuple(p.shape),
                               tuple(mesh.mesh_dim_names) if mesh is not None else None)


def fit(strategy, devices: int, root: str, dp: int = 1, ckpt_path=None, model=None, callbacks=()):
    """A fit of ``STEPS`` steps of two micro-batches each, clipped by value, on ``devices``
    processes, ``dp`` of them splitting each global batch."""
    seed_everything(7)
    model = model or TensorParallelModule(batch_size=GLOBAL_BATCH // dp)
    trainer = Trainer(strategy=strategy, devices=devices, accelerator="cpu", max_steps=STEPS, default_root_dir=root,
                      enable_progress_bar=False, enable_model_summary=False, logger=False, num_sanity_val_steps=0,
                      limit_val_batches=1, accumulate_grad_batches=2, gradient_clip_val=1 / 4,
                      gradient_clip_algorithm="value",  # two micro-batches a step, clipped: both exact
                      callbacks=[ModelCheckpoint(every_n_train_steps=1, save_top_k=-1), *callbacks])
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert type(a[name]) is torch.Tensor and torch.equal(a[name], b[name]), \
            (name, (a[name] - b[name]).abs().max().item())


class LargestGradient(Callback):
    """The largest gradient element before each step's clipping."""

    def __init__(self) -> None:
        self.largest = 0.0

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.largest = max([self.largest] + [p.grad.abs().max().item() for p in module.parameters()])


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process under ``native`` (configure_model does nothing there): the reference."""
    grads = LargestGradient()
    trainer, model = fit("native", 1, str(tmp_path_factory.mktemp("one")), callbacks=[grads])
    assert trainer.global_step == STEPS and model.meshes == []
    assert grads.largest > 1 / 4  # the clipping changes the steps
    return _weights(model)


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mp"))
    layout = Layout()
    trainer, model = fit(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2), 4, root, dp=2,
                         callbacks=[layout])
    return trainer, model, layout, root


def _checkpoint(root: str, step: int) -> str:
    [path] = glob.glob(os.path.join(root, "**", f"epoch=0-step={step}.ckpt"), recursive=True)
    return path


@pytest.mark.multi_device
def test_two_by_two_processes_train_as_one_bitwise(one_process, two_by_two):
    trainer, model, layout, root = two_by_two
    assert trainer.global_step == STEPS and trainer.world_size == 4
    assert model.meshes == [((2, 2), ("data_parallel", "tensor_parallel"))]  # once, in the fit
    # w1 split by its rows (columns of the product) over TP, then by rows again over DP; w2 by its
    # columns over TP and its rows over DP; w2's bias replicated over TP, sharded over DP.
    assert layout.seen["model.w1.weight"] == ("DTensor", (2, 4), ("data_parallel", "tensor_parallel"))
    assert layout.seen["model.w2.weight"] == ("DTensor", (2, 4), ("data_parallel", "tensor_parallel"))
    assert layout.seen["model.w2.bias"] == ("DTensor", (2,), ("data_parallel", "tensor_parallel"))
    # The module is given back whole, plain and on the CPU, and runs on its own.
    _assert_bitwise(_weights(model), one_process)
    assert model.device_mesh is None and not any(type(m).__name__.startswith("FSDP") for m in model.modules())
    assert model.model(torch.ones(2, 4, dtype=torch.float64)).shape == (2, 1)
    assert os.path.isdir(_checkpoint(root, 1))


@pytest.mark.multi_device
@pytest.mark.parametrize("dp, tp, devices", [(4, 1, 4), (1, 1, 1), (None, None, 1)], ids=["4x1", "1x1", "native"])
def test_a_two_by_two_checkpoint_resumes_at_another_mesh_exactly(tmp_path, one_process, two_by_two, dp, tp, devices):
    """Saved at 2 x 2 after step 1 (each process its shards, momentum included), resumed at 4 x 1,
    at one process, and under ``native`` (assembled whole): the run goes on as the uninterrupted
    one, to the bit."""
    trainer, _, _, root = two_by_two
    saved = _checkpoint(root, 1)
    strategy = "native" if dp is None else ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp)
    again, model = fit(strategy, devices, str(tmp_path), dp=dp or 1, ckpt_path=saved)
    assert again.global_step == STEPS and os.path.realpath(again.ckpt_path) == os.path.realpath(saved)
    _assert_bitwise(_weights(model), one_process)
    if dp == 1:  # a second stage in this process parallelizes the module afresh
        [metrics] = again.validate(model, verbose=False)
        assert "val_loss" in metrics and len(model.meshes) == 2  # the resumed fit's, then this stage's
        assert model.meshes[-1] == ((1, 1), ("data_parallel", "tensor_parallel"))


@pytest.mark.multi_device
def test_a_whole_file_checkpoint_of_tensor_parallel_resumes_data_parallel(tmp_path, one_process):
    """``save_distributed_checkpoint=False``: one file, the whole weights and optimizer state;
    written at 1 x 2 (the default mesh of one host: every process tensor parallel), resumed at
    2 x 1 exactly."""
    trainer, model = fit(ModelParallelStrategy(save_distributed_checkpoint=False), 2, str(tmp_path / "a"))
    assert model.meshes == [((1, 2), ("data_parallel", "tensor_parallel"))]
    _assert_bitwise(_weights(model), one_process)
    saved = _checkpoint(str(tmp_path / "a"), 1)
    assert os.path.isfile(saved)
    _, model = fit(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), 2, str(tmp_path / "b"), dp=2,
                   ckpt_path=saved)
    _assert_bitwise(_weights(model), one_process)


class BuiltOnTheMetaDevice(TensorParallelModule):
    """Lightning's example: built under ``trainer.init_module(empty_init=True)``, its weights set
    once training starts."""

    def on_train_start(self):
        self.model.init_weights()


def test_a_module_built_on_the_meta_device_gets_memory_after_configure_model(tmp_path, one_process):
    trainer = Trainer(strategy=ModelParallelStrategy(), devices=1, accelerator="cpu")
    with trainer.init_module(empty_init=True):
        model = BuiltOnTheMetaDevice()
    assert model.model.w1.weight.is_meta
    _, model = fit(ModelParallelStrategy(), 1, str(tmp_path), model=model)
    assert model.meshes == [((1, 1), ("data_parallel", "tensor_parallel"))]
    _assert_bitwise(_weights(model), one_process)


class FailsOnce(TensorParallelModule):
    failed = False

    def configure_model(self):
        if not FailsOnce.failed:
            FailsOnce.failed = True
            raise RuntimeError("configure_model failed")
        super().configure_model()


def test_a_configure_model_that_fails_leaves_no_mesh_and_no_group_behind(tmp_path, one_process):
    import torch.distributed as dist

    model = FailsOnce()
    with pytest.raises(RuntimeError, match="configure_model failed"):
        fit(ModelParallelStrategy(), 1, str(tmp_path / "a"), model=model)
    assert model.device_mesh is None and not dist.is_initialized()
    _, model = fit(ModelParallelStrategy(), 1, str(tmp_path / "b"), model=model)  # the same module, again
    _assert_bitwise(_weights(model), one_process)


def test_a_mesh_that_is_not_the_world_size_is_refused_before_any_process_starts(tmp_path):
    with pytest.raises(ValueError, match=r"makes a mesh of 2 x 2 = 4 processes, but the run has 2: give sizes whose "
                                         r"product is 2"):
        Trainer(strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2), devices=2,
                accelerator="cpu", default_root_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=0\): give a positive int or 'auto'"):
        ModelParallelStrategy(tensor_parallel_size=0)


class Unparallelized(TensorParallelModule):
    def configure_model(self):  # ignores the mesh
        self.meshes.append(tuple(self.device_mesh.shape))


class TensorParallelOnly(TensorParallelModule):
    def configure_model(self):  # no fully_shard over data_parallel
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(self.model, self.device_mesh["tensor_parallel"],
                           {"w1": ColwiseParallel(), "w2": RowwiseParallel()})


@pytest.mark.multi_device
@pytest.mark.parametrize("module, sizes, message", [
    (Unparallelized, (1, 2), r"Unparallelized.configure_model\(\) split no layer over "
                             r"self.device_mesh\['tensor_parallel'\] \(tensor_parallel_size=2\)"),
    (TensorParallelOnly, (2, 1), r"TensorParallelOnly.configure_model\(\) left 4 trainable parameter\(s\) outside "
                                 r"fully_shard over self.device_mesh\['data_parallel'\] \(data_parallel_size=2\)"),
], ids=["tp-unused", "dp-unsharded"])
def test_a_configure_model_that_does_not_use_the_mesh_is_refused(tmp_path, module, sizes, message):
    strategy = ModelParallelStrategy(data_parallel_size=sizes[0], tensor_parallel_size=sizes[1])
    with pytest.raises(ValueError, match=message):
        fit(strategy, 2, str(tmp_path), dp=sizes[0], model=module(batch_size=GLOBAL_BATCH // sizes[0]))
