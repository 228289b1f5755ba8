"""The GPU check (``./dev gpu-check``): the native tests on the GPU, then a GPT-2-small training
benchmark of xtrainer against a hand-written loop, Lightning and the Hugging Face Trainer.

    python benchmarks/gpu_check.py --out DIR            # on a CUDA machine: tests, then GPT-2 124M
    python benchmarks/gpu_check.py --out DIR --tiny     # the same on the CPU, tiny (CI)
    python benchmarks/gpu_check.py --out DIR --skip-tests --contenders hand xtrainer

**Tests**: ``tests/stories/native/test_gpu.py`` under pytest (``native``, ``native_fsdp`` at world size 1,
``torch.compile``, ``bf16-mixed``, a checkpoint round trip, a resume compared bitwise), on
``accelerator="cuda"`` where PyTorch sees a CUDA device.

**Benchmark**: GPT-2 small (12 layers, 12 heads, width 768, sequence 1024, vocabulary 50257; 124M
parameters), built in code with random initialisation, on random tokens from a seeded generator
(nothing is downloaded), micro-batch 16 x 1024 tokens, AdamW (lr 3e-4, betas 0.9/0.95, weight
decay 0.1; fused on CUDA), bfloat16 autocast, ``torch.compile`` (inductor), for every contender:

- ``hand``: a hand-written loop (``torch.autocast``, ``torch.compile`` of the model);
- ``xtrainer``: ``Trainer(accelerator="cuda", strategy=NativeSingle(compile=True), precision="bf16-mixed")``;
- ``lightning``: ``lightning.Trainer(precision="bf16-mixed")`` on a LightningModule whose GPT is
  compiled in place (``nn.Module.compile``), where ``import lightning`` works;
- ``hf_trainer``: the Hugging Face Trainer (``bf16=True``, ``torch_compile=True``, the same AdamW
  given through ``optimizers=``, a constant learning rate) on ``GPT2LMHeadModel`` built from a
  ``GPT2Config`` (where ``transformers`` imports);
- ``xtrainer_hf``: xtrainer as above on that same ``GPT2LMHeadModel``, the pair ``hf_trainer`` is
  compared with.

The GPT of the first three is the ``GPT2LMHeadModel`` architecture (pre-norm blocks, tanh GELU,
tied embeddings, ``scaled_dot_product_attention``, no dropout) written out in this file. Each
contender runs in a process of its own: 30 warm-up steps (compilation included; the contenders
of one check share a fresh Inductor cache, so later ones compile faster), then 50 timed steps
between two CUDA synchronisations. *tokens/s* are the timed steps' tokens over their
time; *MFU* is model FLOPs per second over the GPU's dense bf16 peak (``GPU_PEAK_BF16_FLOPS``, by
the name PyTorch gives the device, or ``XTRAINER_CHIP`` naming an entry of it or of
``xtrainer.flops.PEAK_BF16_FLOPS``), with model FLOPs per token ``6 N + 12 L T d`` (N the
parameters without the position embeddings, L layers, T the sequence, d the width: PaLM's and
nanoGPT's count); the FLOPs ``xtrainer.flops`` counts on the meta device for one step are
reported beside it. ``--tiny`` (2 layers, width 64, sequence 64, vocabulary 512, a few steps, on
the CPU, ``torch.compile`` with its ``eager`` backend) runs the same code in seconds.

Writes ``DIR/gpu_check.json`` (every figure), ``DIR/gpu_check.md`` (the table) and
``DIR/gpu_tests.log`` (pytest's output), and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # the checkout's xtrainer, installed or not
    sys.path.insert(0, ROOT)

CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": {"layers": 12, "heads": 12, "width": 768, "seq": 1024, "vocab": 50257, "batch": 16, "warmup": 30,
             "steps": 50, "backend": "inductor"},
    "tiny": {"layers": 2, "heads": 4, "width": 64, "seq": 64, "vocab": 512, "batch": 4, "warmup": 2, "steps": 3,
             "backend": "eager"},
}
CONTENDERS = ["hand", "xtrainer", "lightning", "xtrainer_hf", "hf_trainer"]
WHAT = {"hand": "hand-written loop (autocast bf16, torch.compile)",
        "xtrainer": "xtrainer native, compile, bf16-mixed",
        "lightning": "Lightning, compiled GPT, bf16-mixed",
        "xtrainer_hf": "xtrainer native, compile, bf16-mixed, on GPT2LMHeadModel",
        "hf_trainer": "HF Trainer, bf16, torch_compile, on GPT2LMHeadModel"}
#: The ratios reported: (name, numerator, denominator), each by tokens/s.
RATIOS = [("xtrainer / hand", "xtrainer", "hand"), ("xtrainer / Lightning", "xtrainer", "lightning"),
          ("xtrainer / HF Trainer (both on GPT2LMHeadModel)", "xtrainer_hf", "hf_trainer")]
#: Dense bfloat16 peak FLOP/s of NVIDIA GPUs (the vendor's datasheets, without sparsity), matched
#: in order against ``torch.cuda.get_device_name()``.
GPU_PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("H200", 989e12), ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("GH200", 989e12),
    ("A100", 312e12), ("L40S", 362e12), ("L4", 121e12), ("A10G", 70e12), ("A10", 125e12),
]


# ---- the model and the data ---------------------------------------------------------------------
class Block(nn.Module):
    """A GPT-2 block: pre-norm causal self-attention and a 4x MLP with tanh GELU, residuals."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.c_attn, self.attn_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.c_fc, self.mlp_proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2 (``GPT2LMHeadModel``'s architecture), random initialisation as GPT-2's (normal, 0.02;
    the residual projections scaled by 1/sqrt(2 layers)). ``forward(input_ids, labels)`` is the
    next-token cross-entropy, as ``GPT2LMHeadModel`` computes it from the same batch."""

    def __init__(self, layers: int, heads: int, width: int, seq: int, vocab: int, **_: Any) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2's
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))


def hf_gpt2(cfg: dict[str, Any]) -> nn.Module:
    """``GPT2LMHeadModel`` from a ``GPT2Config`` of the same shape (no download), no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=cfg["vocab"], n_positions=cfg["seq"], n_embd=cfg["width"], n_layer=cfg["layers"],
                        n_head=cfg["heads"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        attn_implementation="sdpa")
    return GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    """Random tokens from a seeded generator, as a tokenizer gives them: ``input_ids`` and
    ``labels`` (the same tokens; the model shifts them)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        g = torch.Generator().manual_seed(0)
        count = (cfg["warmup"] + cfg["steps"]) * cfg["batch"]
        self.tokens = torch.randint(0, cfg["vocab"], (count, cfg["seq"]), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def make_loader(cfg: dict[str, Any], device_type: str) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(Tokens(cfg), batch_size=cfg["batch"], shuffle=False, drop_last=True,
                                       pin_memory=device_type == "cuda")


def make_optimizer(params, device_type: str) -> torch.optim.Optimizer:
    """Every contender's AdamW; fused on CUDA."""
    return torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                             **({"fused": True} if device_type == "cuda" else {}))


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(every parameter, tied ones once; the position embeddings')."""
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
    position = sum(p.numel() for name, p in model.named_parameters() if name.split(".")[-2:-1] == ["wpe"])
    return total, position


def flops_per_token(params: int, cfg: dict[str, Any]) -> float:
    """Model FLOPs of one token's forward and backward: 6 N + 12 L T d (PaLM, nanoGPT)."""
    return 6.0 * params + 12.0 * cfg["layers"] * cfg["seq"] * cfg["width"]


def peak_flops(device_name: str | None) -> tuple[float | None, str | None]:
    """The dense bf16 peak of the device and the entry it was found under; ``XTRAINER_CHIP`` first."""
    from xtrainer import flops

    chip = os.environ.get("XTRAINER_CHIP")
    if chip:
        peak = flops.peak_flops(chip) or dict(GPU_PEAK_BF16_FLOPS).get(chip)
        return peak, chip if peak else None
    for name, peak in GPU_PEAK_BF16_FLOPS if device_name else []:
        if name in device_name:
            return peak, name
    return None, None


# ---- one contender ---------------------------------------------------------------------------------
class Clock:
    """The time between the end of the warm-up and the end of the timed steps, each read after a
    synchronisation of the device (a host sync at those two steps only; the other steps run
    unobserved); the first step's end, after a synchronisation, for the compile time."""

    def __init__(self, cfg: dict[str, Any], device_type: str) -> None:
        self.warmup, self.total = cfg["warmup"], cfg["warmup"] + cfg["steps"]
        self.device_type = device_type
        self.started = time.perf_counter()
        self.first = self.t0 = self.t1 = None

    def sync(self) -> None:
        if self.device_type != "cpu":
            torch.accelerator.synchronize()

    def step_done(self, step: int) -> None:
        """``step``: optimizer steps done so far."""
        if step == 1:
            self.sync()  # host sync: the first step's end, compilation included
            self.first = time.perf_counter() - self.started
        if step == self.warmup:
            self.sync()  # host sync: the timed steps start here
            self.t0 = time.perf_counter()
        elif step == self.total:
            self.sync()  # host sync: the timed steps end here
            self.t1 = time.perf_counter()

    def result(self, cfg: dict[str, Any]) -> dict[str, Any]:
        if self.t0 is None or self.t1 is None:
            raise RuntimeError(f"the timed steps did not all run (warm-up ended: {self.t0 is not None})")
        seconds = self.t1 - self.t0
        return {"timed_seconds": seconds, "step_ms": 1e3 * seconds / cfg["steps"],
                "tokens_per_s": cfg["steps"] * cfg["batch"] * cfg["seq"] / seconds, "first_step_s": self.first}


def run_hand(cfg: dict[str, Any], device: torch.device) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(**cfg).to(device)
    optimizer = make_optimizer(model.parameters(), device.type)
    step_fn = torch.compile(model, backend=cfg["backend"])
    clock = Clock(cfg, device.type)
    loss = None
    for step, batch in enumerate(make_loader(cfg, device.type), 1):
        input_ids = batch["input_ids"].to(device, non_blocking=True)
        labels = batch["labels"].to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = step_fn(input_ids, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.step_done(step)
    return {**clock.result(cfg), "final_loss": float(loss), "params": parameter_counts(model)}


def _xtrainer_module(cfg: dict[str, Any], device_type: str, hf: bool):
    from xtrainer import XModule

    class Model(XModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = hf_gpt2(cfg) if hf else GPT(**cfg)

        def forward(self, input_ids, labels):
            return self.net(input_ids=input_ids, labels=labels).loss if hf else self.net(input_ids, labels)

        def training_step(self, batch, batch_idx):
            loss = self(batch["input_ids"], batch["labels"])
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return make_optimizer(self.parameters(), device_type)

    return Model()


def run_xtrainer(cfg: dict[str, Any], device: torch.device, hf: bool = False) -> dict[str, Any]:
    from xtrainer import Trainer
    from xtrainer.callbacks import Callback
    from xtrainer.strategies import NativeSingle

    clock = Clock(cfg, device.type)

    class Timing(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            clock.step_done(trainer.global_step)

    model = _xtrainer_module(cfg, device.type, hf)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as root:
        trainer = Trainer(accelerator=device.type, strategy=NativeSingle(compile=True,
                                                                         compile_kwargs={"backend": cfg["backend"]}),
                          devices=1, precision="bf16-mixed", max_steps=cfg["warmup"] + cfg["steps"], logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          default_root_dir=root, callbacks=[Timing()])
        trainer.fit(model, make_loader(cfg, device.type))
    return {**clock.result(cfg), "final_loss": float(trainer.callback_metrics["train_loss"]),
            "params": parameter_counts(model.net)}


def run_lightning(cfg: dict[str, Any], device: torch.device) -> dict[str, Any]:
    import lightning as L

    clock = Clock(cfg, device.type)

    class Timing(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            clock.step_done(trainer.global_step)

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = GPT(**cfg)

        def forward(self, input_ids, labels):
            return self.net(input_ids, labels)

        def training_step(self, batch, batch_idx):
            loss = self(batch["input_ids"], batch["labels"])
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return make_optimizer(self.parameters(), device.type)

    model = Model()
    # The GPT compiled in place, as the other contenders compile it. torch.compile(model), as
    # Lightning's documentation compiles a LightningModule, compiles training_step too, and
    # self.log there stops Dynamo (torch 2.13: "'method' object has no attribute '__dict__'").
    model.net.compile(backend=cfg["backend"])
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as root:
        trainer = L.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, precision="bf16-mixed",
                            max_steps=cfg["warmup"] + cfg["steps"], logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                            callbacks=[Timing()])
        trainer.fit(model, make_loader(cfg, device.type))
    return {**clock.result(cfg), "final_loss": float(trainer.callback_metrics["train_loss"]),
            "params": parameter_counts(model.net)}


def run_hf_trainer(cfg: dict[str, Any], device: torch.device) -> dict[str, Any]:
    from transformers import Trainer as HFTrainer
    from transformers import TrainerCallback, TrainingArguments

    clock = Clock(cfg, device.type)

    class Timing(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.step_done(state.global_step)

    torch.manual_seed(0)
    model = hf_gpt2(cfg).to(device)
    optimizer = make_optimizer(model.parameters(), device.type)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as root:
        args = TrainingArguments(output_dir=root, per_device_train_batch_size=cfg["batch"],
                                 max_steps=cfg["warmup"] + cfg["steps"], bf16=True, torch_compile=True,
                                 torch_compile_backend=cfg["backend"], lr_scheduler_type="constant",
                                 logging_steps=cfg["warmup"] + cfg["steps"], save_strategy="no", report_to="none",
                                 disable_tqdm=True, dataloader_drop_last=True, use_cpu=device.type == "cpu")
        trainer = HFTrainer(model=model, args=args, train_dataset=Tokens(cfg), optimizers=(optimizer, None),
                            callbacks=[Timing()])
        out = trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {**clock.result(cfg), "final_loss": losses[-1] if losses else out.training_loss,
            "params": parameter_counts(model)}


def requirement(contender: str) -> str | None:
    """The package a contender needs, where it is not importable here."""
    import importlib.util

    needs = {"lightning": "lightning", "hf_trainer": "transformers", "xtrainer_hf": "transformers"}.get(contender)
    if needs and importlib.util.find_spec(needs) is None:
        return needs
    if contender == "hf_trainer" and importlib.util.find_spec("accelerate") is None:
        return "accelerate"
    return None


def run_one(contender: str, cfg: dict[str, Any], device_type: str) -> dict[str, Any]:
    device = torch.device(device_type, 0) if device_type != "cpu" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    run = {"hand": run_hand, "xtrainer": run_xtrainer, "lightning": run_lightning, "hf_trainer": run_hf_trainer,
           "xtrainer_hf": lambda c, d: run_xtrainer(c, d, hf=True)}[contender]
    result = run(cfg, device)
    if device.type == "cuda":
        result["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    return result


# ---- the whole check ------------------------------------------------------------------------------
def run_tests(out: str, device_type: str, timeout: float) -> dict[str, Any]:
    """``tests/stories/native/test_gpu.py`` under pytest in a process of its own; its output to ``gpu_tests.log``."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join(ROOT, "tests", "stories",
                                                                                            "native", "test_gpu.py")]
    started = time.perf_counter()
    log = os.path.join(out, "gpu_tests.log")
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
                                  ROOT, os.environ.get("PYTHONPATH")]))})
        text, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        text = f"{err.stdout or ''}{err.stderr or ''}\ngpu_check: pytest ran past {timeout:.0f} s and was stopped"
        text, code = text if isinstance(text, str) else text.decode(errors="replace"), None
    with open(log, "w") as f:
        f.write(text)
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", text.splitlines()[-1]
                                                       if text.strip() else "")}
    return {"returncode": code, "seconds": time.perf_counter() - started, "accelerator": device_type, **counts,
            "log": os.path.basename(log)}


#: Inductor's cache, shared by the contenders of one check (made fresh for it: the first is cold).
INDUCTOR_CACHE = ""


def measure(contender: str, cfg: dict[str, Any], device_type: str, timeout: float) -> dict[str, Any]:
    """One contender in a process of its own (its compilations, memory and failure its own)."""
    missing = requirement(contender)
    if missing:
        return {"status": "not installed", "detail": f"{missing} does not import here"}
    if timeout < 10:
        return {"status": "skipped", "detail": "the check's time budget was spent"}
    command = [sys.executable, os.path.abspath(__file__), "--one", contender, "--config", json.dumps(cfg),
               "--device", device_type]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
           "USE_TORCH_XLA": "0",  # transformers: the device PyTorch has, not torch_xla's, where both are installed
           "TORCHINDUCTOR_CACHE_DIR": INDUCTOR_CACHE}  # one for the check: later contenders reuse kernels
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "detail": f"ran past {timeout:.0f} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("GPU_CHECK_RESULT "):
            return {"status": "ok", **json.loads(line[len("GPU_CHECK_RESULT "):])}
    lines = (done.stderr or done.stdout).strip().splitlines()
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", line)]
    detail = (errors or lines or [f"exit {done.returncode}"])[-1]
    return {"status": "failed", "detail": detail[-300:], "stderr_tail": done.stderr[-4000:]}


def device_description(device_type: str) -> tuple[str, str]:
    if device_type == "cuda":
        return device_type, torch.cuda.get_device_name(0)
    return device_type, platform.processor() or platform.machine()


def counted_flops_per_token(cfg: dict[str, Any]) -> float | None:
    """FLOPs of one training step of the GPT as ``xtrainer.flops`` counts them on the meta device
    (matrix products and attention, forward and backward), per token."""
    from xtrainer import flops

    with torch.device("meta"):
        module = _xtrainer_module(cfg, "meta", hf=False)
    batch = {"input_ids": torch.zeros(cfg["batch"], cfg["seq"], dtype=torch.long, device="meta")}
    batch["labels"] = batch["input_ids"]
    try:
        return flops.count_training_step(module, batch, 0) / (cfg["batch"] * cfg["seq"])
    except Exception as err:  # reported, not fatal: the analytic count stands
        print(f"gpu_check: xtrainer.flops could not count the step ({type(err).__name__}: {err})", file=sys.stderr)
        return None


def table(report: dict[str, Any]) -> str:
    cfg, rows = report["config"], report["rows"]
    lines = [f"# GPU check: {report['device_name']} ({report['accelerator']})", "",
             f"{report['date']}; torch {report['torch']}, Python {report['python']}; "
             f"{cfg['layers']} layers, {cfg['heads']} heads, width {cfg['width']}, sequence {cfg['seq']}, "
             f"vocabulary {cfg['vocab']}; micro-batch {cfg['batch']} x {cfg['seq']} tokens; {cfg['warmup']} warm-up "
             f"+ {cfg['steps']} timed steps; torch.compile backend {cfg['backend']}; "
             f"model FLOPs/token {report['flops_per_token']:.4g} (6N + 12LTd, N = {report['n_params']:,})"
             + (f", {report['flops_per_token_counted']:.4g} counted by xtrainer.flops"
                if report.get("flops_per_token_counted") else "")
             + (f"; peak {report['peak_flops'] / 1e12:.0f} TFLOP/s bf16 ({report['peak_entry']})"
                if report["peak_flops"] else "; no peak FLOP/s known for this device: no MFU") + ".", ""]
    tests = report.get("tests")
    if tests:
        verdict = "passed" if tests["returncode"] == 0 else "FAILED" if tests["returncode"] is not None else "TIMED OUT"
        counts = ", ".join(f"{tests[k]} {k}" for k in ("passed", "failed", "error", "errors", "skipped") if k in tests)
        lines += [f"Tests (`tests/stories/native/test_gpu.py`, accelerator {tests['accelerator']}): {verdict} "
                  f"({counts}; "
                  f"{tests['seconds']:.0f} s; `{tests['log']}`).", ""]
    lines += ["| contender | what | status | tokens/s | ms/step | MFU | final loss | peak memory (GB) | first step (s) |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        ok = row["status"] == "ok"
        fmt = lambda key, spec: format(row[key], spec) if ok and row.get(key) is not None else "-"  # noqa: E731
        status = row["status"] + (f": {row['detail']}" if row.get("detail") else "")
        lines.append(f"| {row['contender']} | {WHAT[row['contender']]} | {status.replace('|', '/')} | "
                     f"{fmt('tokens_per_s', ',.0f')} | {fmt('step_ms', '.1f')} | "
                     f"{format(row['mfu'], '.1%') if ok and row.get('mfu') is not None else '-'} | "
                     f"{fmt('final_loss', '.3f')} | {fmt('peak_memory_gb', '.1f')} | {fmt('first_step_s', '.1f')} |")
    lines += ["", "| ratio (tokens/s) | value |", "| --- | ---: |"]
    for name, value in report["ratios"].items():
        lines.append(f"| {name} | {'-' if value is None else format(value, '.3f')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, ".runs", "gpu_check"),
                        help="folder for gpu_check.json, gpu_check.md, gpu_tests.log (default: $OUT, else "
                             "benchmarks/.runs/gpu_check)")
    parser.add_argument("--tiny", action="store_true", help="the tiny configuration, on the CPU (CI)")
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=CONTENDERS)
    parser.add_argument("--skip-tests", action="store_true", help="the benchmark only")
    parser.add_argument("--steps", type=int, help="timed steps per contender")
    parser.add_argument("--warmup", type=int, help="warm-up steps per contender (compilation included)")
    parser.add_argument("--batch", type=int, help="micro-batch (sequences)")
    parser.add_argument("--budget", type=float, default=570.0,
                        help="seconds the whole check may take; a contender left without time is skipped (570)")
    parser.add_argument("--one", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--device", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:  # a contender's own process
        result = run_one(args.one, json.loads(args.config), args.device)
        print("GPU_CHECK_RESULT " + json.dumps(result), flush=True)
        return 0

    started = time.perf_counter()
    deadline = started + args.budget
    global INDUCTOR_CACHE
    INDUCTOR_CACHE = tempfile.mkdtemp(prefix="gpu-check-inductor-")
    cfg = dict(CONFIGS["tiny" if args.tiny else "gpt2"])
    cfg.update({k: getattr(args, k) for k in ("steps", "warmup", "batch") if getattr(args, k) is not None})
    device_type = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    accelerator, device_name = device_description(device_type)
    if device_type == "cpu" and not args.tiny:
        print("gpu_check: no CUDA device here; the GPT-2 benchmark runs on the CPU (slow): --tiny for a quick check",
              file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    peak, entry = peak_flops(device_name if device_type == "cuda" else None)
    with torch.device("meta"):
        n_params, position = parameter_counts(GPT(**cfg))
    report: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "accelerator": accelerator,
        "device_name": device_name, "torch": torch.__version__, "python": platform.python_version(), "config": cfg,
        "n_params": n_params - position, "n_params_total": n_params,
        "flops_per_token": flops_per_token(n_params - position, cfg),
        "flops_per_token_counted": counted_flops_per_token(cfg), "peak_flops": peak, "peak_entry": entry,
        "rows": [], "ratios": {}}
    json_path, md_path = os.path.join(args.out, "gpu_check.json"), os.path.join(args.out, "gpu_check.md")

    def write() -> None:
        report["seconds"] = time.perf_counter() - started
        by_name = {row["contender"]: row for row in report["rows"]}
        report["ratios"] = {}
        for name, top, bottom in RATIOS:
            a, b = by_name.get(top, {}), by_name.get(bottom, {})
            report["ratios"][name] = a["tokens_per_s"] / b["tokens_per_s"] \
                if a.get("status") == b.get("status") == "ok" else None
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
        with open(md_path, "w") as f:
            f.write(table(report))

    if not args.skip_tests:
        print(f"gpu_check: tests/stories/native/test_gpu.py on {accelerator} ...", flush=True)
        report["tests"] = run_tests(args.out, device_type, timeout=max(60.0, min(240.0, deadline - time.perf_counter())))
        write()
    for contender in args.contenders:
        print(f"gpu_check: {contender} ...", flush=True)
        remaining = deadline - time.perf_counter()
        row = {"contender": contender, **measure(contender, cfg, device_type, timeout=remaining)}
        if row["status"] == "ok":
            n = row["params"][0] - row["params"][1]
            row["flops_per_token"] = flops_per_token(n, cfg)
            row["model_flops_per_s"] = row["tokens_per_s"] * row["flops_per_token"]
            row["mfu"] = row["model_flops_per_s"] / peak if peak else None
        report["rows"].append(row)
        write()
        print(f"gpu_check: {contender}: {row['status']}"
              + (f", {row['tokens_per_s']:,.0f} tokens/s" if row["status"] == "ok" else f" ({row.get('detail', '')})"),
              flush=True)
        if row.get("stderr_tail"):
            print(row["stderr_tail"], file=sys.stderr)
    write()
    shutil.rmtree(INDUCTOR_CACHE, ignore_errors=True)
    print(table(report))
    print(f"gpu_check: wrote {json_path} and {md_path}")
    tests_ok = report.get("tests", {}).get("returncode", 0) == 0
    return 0 if tests_ok and all(r["status"] in ("ok", "not installed") for r in report["rows"]) else 1


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
