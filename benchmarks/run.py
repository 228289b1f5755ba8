"""Where xtrainer stands against a hand-written torch_xla loop, Hugging Face's Trainer and
Accelerate, per strategy and workload.

    python benchmarks/run.py                       # every workload and contender, 3 repeats
    python benchmarks/run.py --quick               # fewer steps and repeats, to try it out
    python benchmarks/run.py --workloads lm --contenders xla_native xla_ddp --no-scaling
    python benchmarks/run.py --workloads hf_llama --contenders xla_native hf_trainer accelerate --no-scaling
    python benchmarks/run.py --native              # the native strategies against hand-written eager loops

Workloads: ``mlp`` (the digits-sized MLP: framework overhead shows), ``lm`` (a 4-layer decoder
transformer, width 256, sequence 128, on synthetic tokens: compute dominates) and ``hf_llama``
(a 2-layer ``LlamaForCausalLM`` from ``transformers``, random init from a ``LlamaConfig``, no
download; batches of 8 x 64 synthetic tokens as a tokenizer gives them: ``input_ids``,
``attention_mask``, ``labels``). Every contender trains the same model on the same data with
AdamW(lr=1e-3) for the same steps.

Contenders: the hand-written loop (torch_xla's documented recipe: ``MpDeviceLoader``,
``xm.optimizer_step``) with torch's default AdamW (its per-tensor path on XLA, ``hand``) and with
``foreach=True`` (``hand_foreach``); the same loop in eager PyTorch on the CPU (a reference
point); the Trainer with ``xla_native`` (which turns ``foreach`` on for XLA tensors where the
user left it unset; ``xla_native_per_tensor`` opts out with AdamW(foreach=False)), ``xla_ddp``, ``xla_fsdp`` (ZeRO-3), ``xla_fsdp_zero2``, ``xla_spmd`` and
``xla_fsdpv2``; Accelerate's documented loop (``accelerate``); and on ``hf_llama`` the Hugging
Face Trainer (``optim="adamw_torch"``) on its torch_xla path, plain (``hf_trainer``), with
XLA FSDP (``hf_trainer_fsdp``) and with SPMD FSDPv2 (``hf_trainer_fsdpv2``). Then a scaling run of
the Trainer's strategies at 1, 2 and 4 replicas (SPMD: devices) on the CPU runtime.

Native contenders (``--native`` runs only these, on ``mlp``): the Trainer with the native
strategies of standard PyTorch on the CPU, ``native`` (one process) and ``native_ddp`` (2 processes
over gloo), each also with ``compile=True`` (``..._compile``), against hand-written eager loops:
``eager`` (the loop above) and ``eager_ddp`` (the loop of PyTorch's DDP tutorial:
``torch.multiprocessing.spawn``, a gloo process group, ``DistributedDataParallel``, a
``DistributedSampler``; 2 processes), each also with the model's forward through ``torch.compile``.
Each process keeps a batch of 64; the figure is the CPU time per step of a process, the mean over
the processes of the group (both processes and their threads: the all-reduce moves waiting from one to
the other from run to run).

Every measurement is a process of its own (``--one``), run interleaved with the others and
repeated, so that noise shows. Inside it, the steady-state rate and the CPU time per step are
measured between host reads after a warm-up (compilation excluded); the time to the first step
includes compiling. Ratios to the hand loop pair each run with the hand loop of the same repeat
that uses the same AdamW path (``hand`` or ``hand_foreach``); the head-to-head table pairs each
of xtrainer's strategies with the Hugging Face Trainer's and Accelerate's runs of the same repeat.
Writes ``benchmarks/RESULTS.md`` and ``benchmarks/results.png``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Callable

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from xtrainer import Trainer, XModule, _xla  # noqa: E402
from xtrainer.callbacks import Callback  # noqa: E402
from xtrainer.strategies import XlaFSDP, XlaFSDPv2  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CONTENDERS = ["hand", "hand_foreach", "eager", "xla_native", "xla_native_per_tensor", "xla_ddp", "xla_fsdp",
              "xla_fsdp_zero2", "xla_spmd", "xla_fsdpv2", "accelerate", "hf_trainer", "hf_trainer_fsdp",
              "hf_trainer_fsdpv2"]
#: The native strategies and the hand-written eager loops they are held to (``native_table``).
NATIVE = ["eager", "native", "eager_compile", "native_compile", "eager_ddp", "native_ddp", "eager_ddp_compile",
          "native_ddp_compile"]
CONTENDERS += [c for c in NATIVE if c not in CONTENDERS]
SPMD = ("xla_spmd", "xla_fsdpv2", "hf_trainer_fsdpv2")
SCALING = ["xla_native", "xla_ddp", "xla_fsdp", "xla_spmd", "xla_fsdpv2"]
HF_TRAINER = ("hf_trainer", "hf_trainer_fsdp", "hf_trainer_fsdpv2")
#: xtrainer's strategy and the peer run it is set against in the head-to-head table (hf_llama).
HEAD_TO_HEAD = [("xla_native", "hf_trainer"), ("xla_native", "accelerate"), ("xla_fsdp", "hf_trainer_fsdp"),
                ("xla_fsdpv2", "hf_trainer_fsdpv2")]
WORKLOADS = {"mlp": {"batch": 64}, "lm": {"batch": 4, "seq": 128, "vocab": 1024, "width": 256, "layers": 4},
             "hf_llama": {"batch": 8, "seq": 64, "vocab": 2048, "width": 256, "ffn": 688, "layers": 2, "heads": 4}}


# ---- the workloads ----------------------------------------------------------------------------
def make_net(workload: str) -> nn.Module:
    torch.manual_seed(0)
    if workload == "mlp":
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    if workload == "hf_llama":
        return make_llama()
    return TinyLM(**{k: v for k, v in WORKLOADS["lm"].items() if k != "batch"})


#: transformers' default attention (sdpa) reads the device in every forward on XLA (see FINDINGS.md);
#: eager attention with the tokenizer's attention_mask reads nothing. ``--hf-attention`` chooses.
HF_ATTENTION = os.environ.get("XTRAINER_BENCH_HF_ATTENTION", "eager")
#: ``--pin``: each training process on one core of its own (rank r on the r-th core it may use)
PIN = os.environ.get("XTRAINER_BENCH_PIN") == "1"


def make_llama() -> nn.Module:
    """A 2-layer Llama from a config (random init, no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = WORKLOADS["hf_llama"]
    config = LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["width"], intermediate_size=cfg["ffn"],
                         num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                         num_key_value_heads=cfg["heads"], max_position_embeddings=cfg["seq"],
                         use_cache=False,  # training: no key/value cache
                         attn_implementation=HF_ATTENTION)
    return LlamaForCausalLM(config)


class TokenBatches(torch.utils.data.Dataset):
    """Synthetic tokenized text as a tokenizer gives it (no padding): input_ids, attention_mask,
    labels (the model shifts them itself)."""

    def __init__(self, tokens: torch.Tensor, mask: bool = True) -> None:
        self.tokens, self.mask = tokens, torch.ones_like(tokens[0]) if mask else None

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = {"input_ids": self.tokens[i], "labels": self.tokens[i]}
        if self.mask is not None:
            item["attention_mask"] = self.mask
        return item


class TinyLM(nn.Module):
    """A decoder-only transformer language model (pre-norm blocks, causal attention)."""

    def __init__(self, seq: int, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(seq, width) * 0.02)
        block = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position
        return self.head(self.blocks(h, mask=self.mask, is_causal=True))


def loss_of(workload: str, net: nn.Module, batch) -> torch.Tensor:
    if workload == "hf_llama":
        return net(**batch).loss
    x, y = batch
    out = net(x)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def make_loader(workload: str, steps: int, samples_per_batch: int) -> DataLoader:
    """``steps`` batches of ``samples_per_batch`` samples."""
    g = torch.Generator().manual_seed(0)
    n = steps * samples_per_batch
    if workload == "mlp":
        x = torch.randn(n, 64, generator=g)
        y = torch.randint(0, 10, (n,), generator=g)
    elif workload == "hf_llama":
        cfg = WORKLOADS["hf_llama"]
        tokens = torch.randint(0, cfg["vocab"], (n, cfg["seq"]), generator=g)
        return DataLoader(TokenBatches(tokens, mask=HF_ATTENTION == "eager"), batch_size=samples_per_batch,
                          shuffle=False, drop_last=True)
    else:
        cfg = WORKLOADS["lm"]
        tokens = torch.randint(0, cfg["vocab"], (n, cfg["seq"] + 1), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
    return DataLoader(TensorDataset(x, y), batch_size=samples_per_batch, shuffle=False, drop_last=True)


def make_optimizer(params, foreach: bool | None = None) -> torch.optim.Optimizer:
    """AdamW(lr=1e-3) for every contender; ``foreach`` None leaves torch's (or the framework's) choice."""
    return torch.optim.AdamW(params, lr=1e-3, **({} if foreach is None else {"foreach": foreach}))


def uses_foreach(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` steps through torch's multi-tensor path: only with ``foreach=True``
    on XLA tensors (torch's default picks it for CUDA tensors only)."""
    return all(group.get("foreach") is True for group in optimizer.param_groups)


class Model(XModule):
    def __init__(self, workload: str, foreach: bool | None = None) -> None:
        super().__init__()
        self.workload, self.foreach = workload, foreach
        self.net = make_net(workload)

    def forward(self, *args, **kwargs):
        return self.net(*args, **kwargs)

    def training_step(self, batch, batch_idx):
        loss = loss_of(self.workload, self, batch)  # through forward: what compile=True compiles
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return make_optimizer(self.parameters(), self.foreach)


# ---- one measurement ----------------------------------------------------------------------------
class Probe(Callback):
    """Times the steady state between host reads (every ``log_every_n_steps``) and counts
    compilations and transfers over it; native contenders: on every rank, gathered to rank 0."""

    def __init__(self, warmup: int, started: float, xla: bool = True) -> None:
        self.warmup, self.started, self.xla = warmup, started, xla
        self.marks: list[tuple[int, float]] = []
        self.first_step = None
        self.counts: dict[str, int] = {}
        self.foreach = None

    def on_train_start(self, trainer, module):
        self.foreach = uses_foreach(trainer.optimizers[0])
        if not self.xla:  # --pin applies to the native contenders (and their hand loops) only
            pin(trainer.global_rank)

    def on_train_end(self, trainer, module):
        if not self.xla:  # every process's marks, for the CPU time of the whole group
            self.ranks = gather_marks(self.marks)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step == 1:
            if self.xla:
                _xla.wait_device_ops()  # host sync: the first step's end, compile included
            self.first_step = time.time() - self.started
        if step >= self.warmup and step % trainer.log_every_n_steps == 0:  # the Trainer just read values
            counts = {"compiles": _xla.compile_count(), "transfers": _xla.transfer_from_device_count()} \
                if self.xla else {}
            if not self.marks:
                self.counts = counts
            self.marks.append(mark(step))
            self.counts_end = counts

    def state_dict(self):
        end = getattr(self, "counts_end", self.counts)
        return {"marks": self.marks, "ranks": getattr(self, "ranks", [self.marks]), "first_step": self.first_step,
                "foreach": self.foreach,
                "compiles": end.get("compiles", 0) - self.counts.get("compiles", 0),
                "transfers": end.get("transfers", 0) - self.counts.get("transfers", 0)}

    def load_state_dict(self, state):
        self.result = state


def measure(workload: str, contender: str, steps: int, warmup: int, devices: int, every: int) -> dict:
    batch = WORKLOADS[workload]["batch"]
    if contender in SPMD:  # one program: the loader yields the global batch, split over the devices
        loader = make_loader(workload, steps, batch * devices)
    else:  # one loader per replica, each yielding `batch`
        loader = make_loader(workload, steps * devices, batch)
    started = time.time()
    if contender in ("hand", "hand_foreach", "eager", "eager_compile"):
        return hand_loop(workload, loader, warmup, every, started, xla=not contender.startswith("eager"),
                         foreach=True if contender == "hand_foreach" else None, compile=contender.endswith("_compile"))
    if contender.startswith("eager_ddp"):
        return hand_ddp(workload, loader, warmup, every, started, devices, compile=contender.endswith("_compile"))
    if contender == "accelerate":
        return accelerate_loop(workload, loader, warmup, every, started)
    if contender in HF_TRAINER:
        return hf_trainer_loop(workload, contender, loader, steps, warmup, every, started)
    # FSDP units: on the Llama, each decoder layer, as the Hugging Face Trainer wraps them by default
    # (from the model's _no_split_modules); elsewhere only the whole module, as before.
    policy = "no_split_modules" if workload == "hf_llama" else None
    if contender == "xla_fsdp_zero2":
        strategy = XlaFSDP(reshard_after_forward=False, auto_wrap_policy=policy)
    elif contender == "xla_fsdp":
        strategy = XlaFSDP(auto_wrap_policy=policy)
    elif contender == "xla_fsdpv2":
        strategy = XlaFSDPv2(auto_wrap_policy=policy)
    elif contender.startswith("native"):
        from xtrainer.strategies import NativeDDP, NativeSingle

        strategy = (NativeDDP if contender.startswith("native_ddp") else NativeSingle)(
            compile=contender.endswith("_compile"))
    else:
        strategy = contender.replace("_per_tensor", "")
    probe = Probe(warmup, started, xla=not contender.startswith("native"))
    trainer = Trainer(strategy=strategy, devices=devices, max_epochs=1, log_every_n_steps=every, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_xla_health=False,
                      enable_model_summary=False, default_root_dir=os.path.join(HERE, ".runs"), callbacks=[probe])
    trainer.fit(Model(workload, foreach=False if contender.endswith("_per_tensor") else None), loader)
    # A fit that ran in other processes hands rank 0's callback state back through load_state_dict.
    state = probe.result if hasattr(probe, "result") else probe.state_dict()
    return summarize(state, batch * devices)


class Marks:
    """The measurement of a loop that is not xtrainer's: a mark at each host read after the
    warm-up (the steady state lies between the first and the last), the first step's end, and
    the compilations and transfers between the first and the last mark."""

    def __init__(self, warmup: int, every: int, started: float, xla: bool = True) -> None:
        self.warmup, self.every, self.started, self.xla = warmup, every, started, xla
        self.marks: list[tuple[int, float, float]] = []
        self.first = None
        self.counts = self.ends = {"compiles": 0, "transfers": 0}

    def first_step(self) -> None:
        if self.xla:
            _xla.sync()  # the loader cuts the graph only when the next batch is taken
            _xla.wait_device_ops()  # host sync: the first step's end, compile included
        self.first = time.time() - self.started

    def due(self, step: int) -> bool:
        return step >= self.warmup and step % self.every == 0 and (not self.marks or self.marks[-1][0] != step)

    def mark(self, step: int) -> None:
        """Called just after the loop read its logged values (the interval's host read)."""
        if self.xla:
            self.ends = {"compiles": _xla.compile_count(), "transfers": _xla.transfer_from_device_count()}
            if not self.marks:
                self.counts = self.ends
        self.marks.append(mark(step))

    def state(self, foreach: bool) -> dict:
        return {"marks": self.marks, "ranks": gather_marks(self.marks) if not self.xla else [self.marks],
                "first_step": self.first, "foreach": foreach,
                "compiles": self.ends["compiles"] - self.counts["compiles"],
                "transfers": self.ends["transfers"] - self.counts["transfers"]}


def gather_marks(marks: list[tuple]) -> list[list[tuple]]:
    """Every process's marks in rank order, where the loop ran in a process group (a host sync
    after the last step, outside the measurement); else this process's."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [marks]
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, marks)
    return ranks


def pin(rank: int) -> None:
    """With ``--pin``: every thread of this process (the main one, gloo's, the intra-op pool) on
    one core, the same for every loop, so that two processes of a group and their threads do not
    trade cores with each other. Threads started later inherit it."""
    if not PIN or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    core = {cores[rank % len(cores)]}
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), core)


def hand_loop(workload: str, loader: DataLoader, warmup: int, every: int, started: float, xla: bool,
              foreach: bool | None = None, compile: bool = False, ddp: bool = False) -> dict:
    """torch_xla's documented loop (``xla``), or the same loop in eager PyTorch on the CPU
    (``compile``: the model's forward through ``torch.compile``; ``ddp``: in a process of a gloo
    group, the model in ``DistributedDataParallel``, as PyTorch's DDP tutorial writes it)."""
    device = _xla.device() if xla else torch.device("cpu")
    if not xla:
        pin(torch.distributed.get_rank() if ddp else 0)
    net = make_net(workload).to(device)
    if compile:  # torch.compile(net): net.compile() leaves an nn.Sequential eager (torch 2.9 skips its frame)
        net = torch.compile(net)
    if ddp:  # around the compiled module, as NativeDDP(compile=True) wraps it
        net = nn.parallel.DistributedDataParallel(net)
    opt = make_optimizer(net.parameters(), foreach)
    marks = Marks(warmup, every, started, xla)
    if xla:  # the documented torch_xla loader, as a hand-written loop uses it
        from torch_xla.distributed.parallel_loader import MpDeviceLoader

        batches = MpDeviceLoader(loader, device)
    else:
        batches = loader
    for step, batch in enumerate(batches, start=1):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(workload, net, batch)
        loss.backward()
        if xla:
            _xla.optimizer_step(opt)
        else:
            opt.step()
        if step == 1:
            marks.first_step()
        if marks.due(step):
            if xla:
                _xla.sync()
            loss.item()  # host sync: read the loss, as a training loop logs it
            marks.mark(step)
    return summarize(marks.state(uses_foreach(opt) and xla), loader.batch_size)


def hand_ddp(workload: str, loader: DataLoader, warmup: int, every: int, started: float, processes: int,
             compile: bool) -> dict:
    """The DDP tutorial's loop: ``processes`` processes started by ``torch.multiprocessing.spawn``
    over gloo, each reading its share of ``loader``'s data; rank 0's measurement, with every rank's marks."""
    import torch.multiprocessing as mp

    from xtrainer.strategies.launchers.processes import free_port

    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_hand_ddp_rank, args=(processes, free_port(), workload, loader, warmup, every, started, compile, results),
             nprocs=processes, join=True)
    return results.get()


def _hand_ddp_rank(rank: int, processes: int, port: int, workload: str, loader: DataLoader, warmup: int, every: int,
                   started: float, compile: bool, results) -> None:
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=processes)
    sampler = DistributedSampler(loader.dataset, shuffle=False)
    share = DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler, drop_last=True)
    out = hand_loop(workload, share, warmup, every, started, xla=False, compile=compile, ddp=True)
    out["samples_per_s"] *= processes
    if rank == 0:
        results.put(out)
    dist.destroy_process_group()


def accelerate_loop(workload: str, loader: DataLoader, warmup: int, every: int, started: float) -> dict:
    """Accelerate's documented training loop (its XLA path: ``MpDeviceLoader``, gradients
    all-reduced in ``optimizer.step()``); the loss read as the hand loop reads it."""
    from accelerate import Accelerator

    accelerator = Accelerator()
    net = make_net(workload)
    opt = make_optimizer(net.parameters())
    net, opt, batches = accelerator.prepare(net, opt, loader)
    marks = Marks(warmup, every, started)
    for step, batch in enumerate(batches, start=1):
        opt.zero_grad()
        loss = loss_of(workload, net, batch)
        accelerator.backward(loss)
        opt.step()
        if step == 1:
            marks.first_step()
        if marks.due(step):
            _xla.sync()
            loss.item()  # host sync: read the loss, as a training loop logs it
            marks.mark(step)
    return summarize(marks.state(uses_foreach(opt.optimizer)), loader.batch_size)


def hf_trainer_loop(workload: str, contender: str, loader: DataLoader, steps: int, warmup: int, every: int,
                    started: float) -> dict:
    """The Hugging Face Trainer on its torch_xla path, as its documentation sets it up:
    ``optim="adamw_torch"`` (its default, ``adamw_torch_fused``, fails on XLA tensors), the
    learning rate held constant and no clipping (so that it does the hand loop's work; it still
    computes the gradient norm it logs), ``fsdp_config={"xla": True}`` for XLA FSDP (auto-wrapping
    the model's ``_no_split_modules``) and ``{"xla": True, "xla_fsdp_v2": True}`` with SPMD and
    a global mesh for FSDPv2."""
    if workload != "hf_llama":
        raise SystemExit(f"{contender} trains Hugging Face models: workload hf_llama only.")
    if contender == "hf_trainer_fsdpv2":
        _xla.use_spmd()  # before any XLA tensor exists, as torch_xla's SPMD needs
        count = _xla.spmd_device_count()
        _xla.set_global_mesh(_xla.mesh((count, 1), ("fsdp", "tensor")))
    import transformers
    from transformers import TrainerCallback, TrainingArguments

    marks = Marks(warmup, every, started)

    class HFProbe(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                marks.first_step()

        def on_log(self, args, state, control, logs=None, **kwargs):  # after the Trainer read the logged values
            if marks.due(state.global_step):
                marks.mark(state.global_step)

    class HFTrainer(transformers.Trainer):
        def _wrap_model(self, model, *args, **kwargs):
            # transformers 5.x delays creating the optimizer under XLA FSDP until the model is
            # wrapped, then never creates it (`_prepare_for_training` skips `accelerator.prepare`
            # for a wrapped model): the documented XLA FSDP set-up fails with "'NoneType' object has
            # no attribute 'param_groups'". Creating it here, from the wrapped model, is the fix.
            wrapped = super()._wrap_model(model, *args, **kwargs)
            if self.is_fsdp_xla_enabled and self.optimizer is None:
                self.create_optimizer(wrapped)
            return wrapped

    fsdp = {}
    if contender == "hf_trainer_fsdp":
        fsdp = {"fsdp": "full_shard", "fsdp_config": {"xla": True}}
    elif contender == "hf_trainer_fsdpv2":
        fsdp = {"fsdp": "full_shard", "fsdp_config": {"xla": True, "xla_fsdp_v2": True}}
    args = TrainingArguments(
        output_dir=os.path.join(HERE, ".runs", "hf"), per_device_train_batch_size=loader.batch_size,
        max_steps=steps, logging_steps=every, report_to="none", optim="adamw_torch", learning_rate=1e-3,
        weight_decay=0.01, lr_scheduler_type="constant", max_grad_norm=0.0, save_strategy="no",
        dataloader_drop_last=True, disable_tqdm=True, seed=0, **fsdp)
    trainer = HFTrainer(model=make_net(workload), args=args, train_dataset=loader.dataset, callbacks=[HFProbe()])
    trainer.train()
    return summarize(marks.state(uses_foreach(trainer.optimizer)), loader.batch_size)


def callgrind_window(step: int) -> None:
    """Under ``instructions.py`` (``XTRAINER_BENCH_CALLGRIND=first,last``): valgrind's callgrind
    counts this process's instructions from the mark at step ``first`` to the one at ``last``,
    then writes them out. Under ``perf record -D -1 --control=fifo:FIFO``
    (``XTRAINER_BENCH_PERF=first,last,FIFO``): perf samples from the mark at ``first`` to the one
    at ``last`` only, the steady state without start-up and exit. Nothing otherwise."""
    perf = os.environ.get("XTRAINER_BENCH_PERF")
    if perf:
        first, last, fifo = perf.split(",", 2)
        if step in (int(first), int(last)):
            with open(fifo, "w") as control:
                control.write("enable\n" if step == int(first) else "disable\n")
    window = os.environ.get("XTRAINER_BENCH_CALLGRIND")
    if not window:
        return
    first, last = (int(x) for x in window.split(","))
    if step in (first, last):
        pid = str(os.getpid())
        subprocess.run(["callgrind_control", "-i", "on" if step == first else "off", pid], capture_output=True)
        if step == last:
            subprocess.run(["callgrind_control", "-d", "window", pid], capture_output=True)


def mark(step: int) -> tuple:
    """The clocks at a host read: wall, the process's CPU time, and its user and system time and
    context switches (voluntary: it waited; involuntary: the scheduler took its core), and the CPU
    time of the thread that runs the loop (the marks are taken there)."""
    callgrind_window(step)
    use = resource.getrusage(resource.RUSAGE_SELF)
    return (step, time.perf_counter(), time.process_time(), use.ru_utime, use.ru_stime, use.ru_nvcsw, use.ru_nivcsw,
            time.thread_time())


def summarize(state: dict, samples_per_step: int) -> dict:
    """Rank 0's wall clock; CPU time, user and system time and context switches per step as the
    mean over the processes of the group (every thread of each process), from each one's first
    mark to its last (the same steps on every rank)."""
    (s0, t0, *_), (s1, t1, *_) = state["marks"][0], state["marks"][-1]
    rate = (s1 - s0) / (t1 - t0)
    per_rank = [per_step(marks) for marks in state.get("ranks") or [state["marks"]]]
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    return {"steps_per_s": rate, "samples_per_s": rate * samples_per_step,
            **{key: statistics.fmean(rank[key] for rank in per_rank) for key in per_rank[0]},
            "rank_cpu_ms_per_step": [rank["cpu_ms_per_step"] for rank in per_rank],
            "first_step_s": state["first_step"], "compiles": state["compiles"],
            "transfers_per_step": state["transfers"] / max(s1 - s0, 1), "peak_mb": peak / 1024,
            "foreach": bool(state.get("foreach"))}


def per_step(marks: list[tuple]) -> dict[str, float]:
    """One process's clocks per step between its first and last mark (``mark``)."""
    (s0, _, c0, *use0), (s1, _, c1, *use1) = marks[0], marks[-1]
    steps = s1 - s0
    return {"cpu_ms_per_step": 1000 * (c1 - c0) / steps,  # every thread of the process that ran the steps
            "user_ms_per_step": 1000 * (use1[0] - use0[0]) / steps, "sys_ms_per_step": 1000 * (use1[1] - use0[1]) / steps,
            "waits_per_step": (use1[2] - use0[2]) / steps, "preemptions_per_step": (use1[3] - use0[3]) / steps,
            "loop_ms_per_step": 1000 * (use1[4] - use0[4]) / steps}  # the loop's thread alone


# ---- the driver ----------------------------------------------------------------------------------
def run_one(workload: str, contender: str, args: argparse.Namespace, devices: int = 1) -> dict | None:
    steps, warmup = (args.steps[workload], args.warmup)
    cmd = [sys.executable, __file__, "--one", workload, contender, str(steps), str(warmup), str(devices), str(args.every)]
    env = dict(os.environ)
    if contender in NATIVE:  # one intra-op thread per process, as torchrun sets it: see native_table
        env.setdefault("OMP_NUM_THREADS", "1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        print(f"  {workload}/{contender}/x{devices} failed:\n{done.stderr[-1500:]}", flush=True)
        return None
    return json.loads(lines[-1])


def runs_on(workload: str, contender: str) -> bool:
    """The Hugging Face Trainer trains Hugging Face models only: the hf_llama workload."""
    return contender not in HF_TRAINER or workload == "hf_llama"


def hf_installed() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("transformers", "accelerate"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 repeat, fewer steps")
    parser.add_argument("--steps", type=int, help="steps per run for every workload (default: mlp 300, lm 40, "
                        "hf_llama 60; --quick: 120, 25, 30)")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--contenders", nargs="+", default=CONTENDERS, choices=CONTENDERS)
    parser.add_argument("--hf-attention", choices=("eager", "sdpa"), default=HF_ATTENTION,
                        help="the Llama's attention: eager with the tokenizer's attention_mask (default), or "
                             "transformers' default sdpa without one (which reads the device every forward on XLA)")
    parser.add_argument("--no-scaling", action="store_true")
    parser.add_argument("--native", action="store_true",
                        help="only the native strategies and the hand-written eager loops, on mlp and lm (or "
                             "--workloads, --contenders among them); their table replaces the native section of "
                             "RESULTS.md")
    parser.add_argument("--pin", action="store_true",
                        help="the native contenders and their hand loops: each process and all its threads on one "
                             "core of its own (rank r on the r-th allowed core)")
    parser.add_argument("--one", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        workload, contender, steps, warmup, devices, every = args.one
        print(json.dumps(measure(workload, contender, int(steps), int(warmup), int(devices), int(every))), flush=True)
        return
    os.environ["XTRAINER_BENCH_HF_ATTENTION"] = args.hf_attention  # read by the --one processes
    if args.pin:
        os.environ["XTRAINER_BENCH_PIN"] = "1"
    steps = {"mlp": 300, "lm": 40, "hf_llama": 60} if not args.quick else {"mlp": 120, "lm": 25, "hf_llama": 30}
    args.steps_given = args.steps
    args.steps = steps if args.steps is None else dict.fromkeys(steps, args.steps)
    args.warmup, args.every = 10, 10
    args.repeats = 1 if args.quick else args.repeats
    if args.native:
        args.no_scaling = True
        if args.workloads == list(WORKLOADS):  # not given: the smallest step, where the loop's own cost shows, and lm
            args.workloads = ["mlp", "lm"]
        args.contenders = [c for c in args.contenders if c in NATIVE] if args.contenders != CONTENDERS else NATIVE
    if not hf_installed():
        dropped = [c for c in args.contenders if c == "accelerate" or c in HF_TRAINER]
        print("transformers and accelerate are not installed (pip install -e '.[hf]'): skipping the hf_llama "
              f"workload and {', '.join(dropped) or 'no contender'}.", flush=True)
        args.workloads = [w for w in args.workloads if w != "hf_llama"]
        args.contenders = [c for c in args.contenders if c not in dropped]
    # the ratios' references come first: the hand loop, with each AdamW path
    contenders = ["hand", "hand_foreach"] + [c for c in args.contenders if c not in ("hand", "hand_foreach")]
    if args.native:
        contenders = args.contenders
    results: Results = {}
    for r in range(args.repeats):
        for workload in args.workloads:
            # interleaved: every contender once per repeat, in the reverse order every other
            # repeat, so that no contender always runs right after another one
            for contender in contenders if r % 2 == 0 else contenders[::-1]:
                if runs_on(workload, contender):
                    devices = native_processes(contender)
                    record(results, (workload, contender, devices), r, run_one(workload, contender, args, devices))
        if not args.no_scaling:
            for devices in (2, 4):
                for contender in SCALING:
                    record(results, ("mlp", contender, devices), r, run_one("mlp", contender, args, devices))
    os.makedirs(os.path.join(HERE, ".runs"), exist_ok=True)
    with open(os.path.join(HERE, ".runs", "results.json"), "w") as f:  # every measurement, for a second look
        json.dump([{"workload": w, "contender": c, "devices": d, "repeat": r, **out}
                   for (w, c, d), runs in results.items() for r, out in runs.items()], f, indent=1)
    if args.native:
        write_native_results(results, args)
    else:
        write_results(results, args, contenders)


def native_processes(contender: str) -> int:
    """How many processes a native contender trains on: 2 for the DDP ones, else 1."""
    return 2 if contender in NATIVE and "_ddp" in contender else 1


#: (workload, contender, devices) -> {repeat: measurement}
Results = dict[tuple[str, str, int], dict[int, dict]]


def record(results: Results, key: tuple[str, str, int], repeat: int, out: dict | None) -> None:
    if out is None:
        return
    results.setdefault(key, {})[repeat] = out
    workload, contender, devices = key
    print(f"repeat {repeat} {workload:<8} x{devices} {contender:<18} {out['steps_per_s']:8.2f} steps/s "
          f"{out['cpu_ms_per_step']:9.1f} CPU ms/step {out['transfers_per_step']:.2f} reads/step "
          f"{out['compiles']} compilations", flush=True)


def median(runs: dict[int, dict], key: str) -> float:
    return statistics.median(r[key] for r in runs.values())


def ratios(runs: dict[int, dict], base: dict[int, dict], ratio: Callable[[dict, dict], float]) -> list[float]:
    return sorted(ratio(runs[r], base[r]) for r in runs if r in base)


def paired(runs: dict[int, dict], base: dict[int, dict], ratio: Callable[[dict, dict], float]) -> str:
    """Median and range of the ratio to the reference measured in the same repeat (next to it in
    time), so that the machine's drift between repeats cancels."""
    values = ratios(runs, base, ratio)
    if not values:
        return "n/a"
    spread = f" ({values[0]:.2f}-{values[-1]:.2f})" if len(values) > 1 else ""
    return f"{statistics.median(values):.3f}{spread}"


def wall_ratio(run: dict, base: dict) -> float:
    return run["steps_per_s"] / base["steps_per_s"]


def cpu_ratio(run: dict, base: dict) -> float:
    return base["cpu_ms_per_step"] / run["cpu_ms_per_step"]


def reference(results: Results, workload: str, runs: dict[int, dict]) -> dict[int, dict]:
    """The hand loop a contender is compared with: the one whose AdamW takes the same path (eager
    PyTorch: the XLA hand loop with torch's default)."""
    name = "hand_foreach" if any(run.get("foreach") for run in runs.values()) else "hand"
    return results.get((workload, name, 1), {})


def write_results(results: Results, args: argparse.Namespace, contenders: list[str]) -> None:
    lines = ["# Benchmark results", "",
             f"{datetime.date.today()}; {platform.machine()} with {os.cpu_count()} cores, Python "
             f"{platform.python_version()}, torch {torch.__version__}, torch_xla {_xla.TORCH_XLA_VERSION}"
             f"{versions()}, XLA CPU runtime; {args.repeats} repeat(s), medians (ranges in brackets); "
             "`python benchmarks/run.py`.",
             "",
             "*vs hand loop* compares each contender with the hand loop of the same repeat whose AdamW takes the "
             "same path (*AdamW path*: `per-tensor`, torch's default for XLA tensors, or `foreach`; the reference "
             "is `hand` or `hand_foreach`). *Wall* is steps/s; *CPU* is the hand loop's CPU time per step over "
             "the contender's (all threads of the process: the host's tracing and the CPU runtime's execution). "
             "On a shared virtual machine the wall clock drifts with other tenants' load; CPU time does not, so "
             "it is the steadier of the two.", ""]
    for workload in args.workloads:
        lines += [f"## {workload}: {args.steps[workload]} steps, batch {WORKLOADS[workload]['batch']}", "",
                  "| contender | AdamW path | steps/s | samples/s | vs hand loop (wall) | vs hand loop (CPU) "
                  "| CPU ms/step | first step (s) | compilations after warm-up | host reads per step "
                  "| peak host memory (MB) |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for contender in contenders:
            runs = results.get((workload, contender, 1))
            if not runs or (contender in NATIVE and contender != "eager"):  # native: a table of its own
                continue
            base = reference(results, workload, runs)
            compiles, reads = (f"{median(runs, 'compiles'):.0f}", f"{median(runs, 'transfers_per_step'):.2f}") \
                if contender != "eager" else ("-", "-")  # eager PyTorch compiles nothing and has no device
            path = "foreach" if any(run.get("foreach") for run in runs.values()) else "per-tensor"
            lines.append(
                f"| {contender} | {path if contender != 'eager' else '-'} | {median(runs, 'steps_per_s'):.2f} "
                f"| {median(runs, 'samples_per_s'):.0f} "
                f"| {paired(runs, base, wall_ratio)} | {paired(runs, base, cpu_ratio)} "
                f"| {median(runs, 'cpu_ms_per_step'):.1f} | {median(runs, 'first_step_s'):.1f} "
                f"| {compiles} | {reads} | {median(runs, 'peak_mb'):.0f} |")
        gain = paired(results.get((workload, "hand_foreach", 1), {}), results.get((workload, "hand", 1), {}), cpu_ratio)
        lines += ["", f"AdamW(foreach=True) against torch's default per-tensor path, hand loop, CPU time: {gain} "
                  "(above 1: foreach costs less).", ""]
    if "hf_llama" in args.workloads:
        lines += head_to_head(results)
    if any(key[1] in NATIVE[1:] for key in results):
        lines += native_table(results, args)
    if any(key[2] > 1 for key in results):
        lines += ["## Scaling on the CPU runtime (mlp, samples/s over all replicas or devices)", "",
                  "| strategy | 1 | 2 | 4 | efficiency at 4 |", "| --- | ---: | ---: | ---: | ---: |"]
        for contender in SCALING:
            rates = [median(results[("mlp", contender, d)], "samples_per_s") if ("mlp", contender, d) in results
                     else float("nan") for d in (1, 2, 4)]
            lines.append(f"| {contender} | {rates[0]:.0f} | {rates[1]:.0f} | {rates[2]:.0f} "
                         f"| {rates[2] / (4 * rates[0]):.2f} |")
        lines += ["", "Each replica or virtual device keeps a batch of "
                  f"{WORKLOADS['mlp']['batch']} (SPMD: the global batch grows with the devices). The replicas of the "
                  "CPU runtime are threads sharing this machine's cores, and every graph cut waits for its replica's "
                  "execution (see `xtrainer/strategies/cpu_threads/`); SPMD's virtual devices share them too. "
                  "These numbers show what multi-device runs cost on a laptop, not how a TPU pod scales.", ""]
    findings = os.path.join(HERE, "FINDINGS.md")  # what was learnt from the numbers, kept across runs
    if os.path.exists(findings):
        with open(findings) as f:
            lines += ["", f.read()]
    with open(os.path.join(HERE, "RESULTS.md"), "w") as f:
        f.write("\n".join(lines))
    plot(results, args, contenders)
    print("\n".join(lines))


NATIVE_SECTION = "## Native strategies against hand-written eager loops"


def native_table(results: Results, args: argparse.Namespace) -> list[str]:
    """Each native contender beside the hand-written loop it is held to, paired by repeat."""
    lines = [NATIVE_SECTION, "",
             f"{datetime.date.today()}; {platform.machine()} with {os.cpu_count()} cores ({platform.processor() or 'cpu'})"
             f", Python {platform.python_version()}, torch {torch.__version__}, CPU, gloo; "
             + ", ".join(f"{w} {args.steps[w]} steps, batch {WORKLOADS[w]['batch']} per process"
                         for w in args.workloads)
             + f" ({args.warmup} warm-up), {args.repeats} repeat(s), medians (ranges in brackets); "
             f"`python benchmarks/run.py --native{' --quick' if args.quick else ''}"
             f"{' --workloads ' + ' '.join(args.workloads) if args.workloads != ['mlp', 'lm'] else ''}"
             f"{f' --steps {args.steps_given}' if args.steps_given else ''}"
             f"{f' --repeats {args.repeats}' if args.repeats != 3 and not args.quick else ''}"
             f"{' --pin' if args.pin else ''}`"
             f"{' (each process and its threads on one core of its own)' if args.pin else ''}.", "",
             "*CPU ms/step*: a process's CPU time per step (every thread of it) between host reads after the "
             "warm-up; on 2 processes, the mean of the two. *Overhead*: the contender's CPU time over the hand loop's "
             "of the same repeat, minus 1 (the goal: at most +3%). *Loop thread*: the same for the CPU time of the "
             "thread that runs the loop alone (Python, the kernels, the optimizer), without gloo's communication "
             "thread, whose time is the same work in both but moves with the processes' timing. *Best of repeats*: "
             "the contender's least CPU time per step over the hand loop's least, minus 1: the machine's other "
             "tenants only ever add time to a run, so the least of many repeats is the one they disturbed least "
             "(as `timeit` reports).", "",
             "| workload | contender | processes | CPU ms/step | hand-written loop | its CPU ms/step | overhead (CPU) "
             "| overhead (loop thread) | best of repeats (CPU) | steps/s (wall) | first step (s) |",
             "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for workload, contender in itertools.product(args.workloads, NATIVE):
        if not contender.startswith("native"):
            continue
        n = native_processes(contender)
        mine = results.get((workload, contender, n))
        hand = contender.replace("native", "eager")
        base = results.get((workload, hand, n))
        if not mine:
            continue
        lines.append(f"| {workload} | {contender} | {n} | {median(mine, 'cpu_ms_per_step'):.2f} | {hand} "
                     f"| {median(base, 'cpu_ms_per_step') if base else float('nan'):.2f} "
                     f"| {overhead(mine, base, 'cpu_ms_per_step')} | {overhead(mine, base, 'loop_ms_per_step')} "
                     f"| {best_of(mine, base, 'cpu_ms_per_step')} | {median(mine, 'steps_per_s'):.1f} "
                     f"| {median(mine, 'first_step_s'):.1f} |")
    return lines + [""]


def best_of(mine: dict[int, dict], base: dict[int, dict] | None, key: str) -> str:
    """The least ``key`` of ``mine``'s repeats over the least of the hand loop's, minus 1."""
    if not base:
        return "n/a"
    return f"{min(r[key] for r in mine.values()) / min(r[key] for r in base.values()) - 1:+.1%}"


def overhead(mine: dict[int, dict], base: dict[int, dict] | None, key: str) -> str:
    """The median of ``mine``'s ``key`` over the hand loop's of the same repeat, minus 1, and its range."""
    over = ratios(mine, base or {}, lambda run, b: run[key] / b[key] - 1) if all(
        key in run for run in [*mine.values(), *(base or {}).values()]) else []
    if not over:
        return "n/a"
    spread = f" ({over[0]:+.1%} to {over[-1]:+.1%})" if len(over) > 1 else ""
    return f"{statistics.median(over):+.1%}{spread}"


def write_native_results(results: Results, args: argparse.Namespace) -> None:
    """The native table, in place of the native section of RESULTS.md (the rest is kept)."""
    path = os.path.join(HERE, "RESULTS.md")
    kept = open(path).read() if os.path.exists(path) else "# Benchmark results\n"
    if NATIVE_SECTION in kept:
        head, _, tail = kept.partition(NATIVE_SECTION)
        rest = tail.split("\n## ", 1)
        kept = head + ("## " + rest[1] if len(rest) > 1 else "")
    table = native_table(results, args)
    marker = "\n## Scaling" if "\n## Scaling" in kept else None
    if marker:  # before the scaling section and the findings
        head, _, tail = kept.partition(marker)
        text = head.rstrip("\n") + "\n\n" + "\n".join(table) + marker + tail
    else:
        text = kept.rstrip("\n") + "\n\n" + "\n".join(table)
    with open(path, "w") as f:
        f.write(text)
    print("\n".join(table))


def versions() -> str:
    try:
        import accelerate
        import transformers
    except ImportError:
        return ""
    return f", transformers {transformers.__version__}, accelerate {accelerate.__version__}"


def head_to_head(results: Results) -> list[str]:
    """xtrainer's strategies against the Hugging Face Trainer's and Accelerate's on hf_llama,
    each pair from the same repeat."""
    lines = ["## Head to head on hf_llama: xtrainer against the Hugging Face Trainer and Accelerate", "",
             "Each row pairs an xtrainer strategy with a peer's run of the same repeat. *Peer CPU / xtrainer CPU* "
             "above 1: xtrainer's step costs less CPU time; *xtrainer / peer (wall)* above 1: xtrainer is faster.",
             "",
             "| xtrainer | peer | xtrainer CPU ms/step | peer CPU ms/step | peer CPU / xtrainer CPU "
             "| xtrainer / peer (wall) | compilations after warm-up (xtrainer / peer) "
             "| host reads per step (xtrainer / peer) | first step, s (xtrainer / peer) "
             "| peak host MB (xtrainer / peer) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    pairs = HEAD_TO_HEAD + [("xla_native_per_tensor", "hf_trainer")]
    for ours, theirs in pairs:
        mine, peer = results.get(("hf_llama", ours, 1)), results.get(("hf_llama", theirs, 1))
        if not mine or not peer:
            continue
        lines.append(
            f"| {ours} | {theirs} | {median(mine, 'cpu_ms_per_step'):.1f} | {median(peer, 'cpu_ms_per_step'):.1f} "
            f"| {paired(mine, peer, cpu_ratio)} | {paired(mine, peer, wall_ratio)} "
            f"| {median(mine, 'compiles'):.0f} / {median(peer, 'compiles'):.0f} "
            f"| {median(mine, 'transfers_per_step'):.2f} / {median(peer, 'transfers_per_step'):.2f} "
            f"| {median(mine, 'first_step_s'):.1f} / {median(peer, 'first_step_s'):.1f} "
            f"| {median(mine, 'peak_mb'):.0f} / {median(peer, 'peak_mb'):.0f} |")
    return lines + [""]


def plot(results: Results, args: argparse.Namespace, contenders: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(args.workloads), figsize=(6 * len(args.workloads), 3.8), squeeze=False)
    for ax, workload in zip(axes[0], args.workloads):
        names = [c for c in contenders if (workload, c, 1) in results
                 and ratios(results[(workload, c, 1)], reference(results, workload, results[(workload, c, 1)]), cpu_ratio)]
        for offset, (label, ratio) in zip((-0.2, 0.2), (("wall", wall_ratio), ("CPU time", cpu_ratio))):
            values = [statistics.median(ratios(results[(workload, c, 1)],
                                               reference(results, workload, results[(workload, c, 1)]), ratio))
                      for c in names]
            ax.bar([i + offset for i in range(len(names))], values, width=0.4, label=label)
        ax.set_xticks(range(len(names)), names, rotation=40, ha="right", fontsize=8)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"{workload}: vs the hand loop, same AdamW path\n(higher is faster)", fontsize=10)
        ax.legend()
    figure.tight_layout()
    figure.savefig(os.path.join(HERE, "results.png"), dpi=100)


if __name__ == "__main__":
    main()
