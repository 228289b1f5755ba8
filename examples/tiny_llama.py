"""Train a tiny Llama (Hugging Face ``transformers``, built from a config: no download) on text
that comes with Python, under FSDP: the whole glue is the short ``XModule`` below.

From the repository's root folder (``pip install -e '.[hf]'`` first):

    xtrainer fit --config examples/tiny_llama.yaml                          # xla_fsdpv2 over 4 devices
    xtrainer fit --config examples/tiny_llama.yaml trainer.strategy.name=xla_fsdp trainer.devices=2
    xtrainer fit --config examples/tiny_llama.yaml trainer.strategy.auto_wrap_policy=no_split_modules
    python examples/tiny_llama.py trainer.max_epochs=2                      # the same, as a script

The strategy wraps each ``LlamaDecoderLayer`` in its own FSDP unit (named in the YAML file as a
string, or taken from the model's ``_no_split_modules`` with ``auto_wrap_policy: no_split_modules``)
and recomputes its activations in backward (``activation_checkpointing: true``).

The text is the Zen of Python (read from the ``this`` module's source, which every Python has),
or any UTF-8 file given as ``data.path``; tokens are its bytes (vocabulary 256), so no tokenizer
is downloaded either. Batches are what a tokenizer gives a Hugging Face model: ``input_ids``,
``attention_mask`` and ``labels`` (the model shifts the labels itself).

On XLA, give the model the ``attention_mask``, and use ``attn_implementation="eager"``: with
transformers' default (``"sdpa"``) the mask preparation checks the mask's (or the positions')
values on the host in every forward (``padding_mask.all()``, the packed-sequence check), which is a
device-to-host read per step that stalls the host until the device has caught up
(``benchmarks/FINDINGS.md``). Eager attention with a mask makes the same causal mask on the device.
"""

from __future__ import annotations

import codecs
import importlib.util
import os
import sys

import torch
from torch.utils.data import DataLoader, Dataset

from xtrainer import XModule

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_llama.yaml")


class TinyLlama(XModule):
    """A ``LlamaForCausalLM`` from a ``LlamaConfig`` (random init), trained on its own loss."""

    def __init__(self, vocab_size: int = 256, hidden_size: int = 128, intermediate_size: int = 344,
                 num_hidden_layers: int = 2, num_attention_heads: int = 4, max_position_embeddings: int = 64,
                 lr: float = 3e-3, attn_implementation: str = "eager") -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.save_hyperparameters()
        config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                             num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                             num_key_value_heads=num_attention_heads, max_position_embeddings=max_position_embeddings,
                             use_cache=False, attn_implementation=attn_implementation)
        self.model = LlamaForCausalLM(config)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss, prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def zen_of_python() -> str:
    """The Zen of Python, from the ``this`` module's source (importing it would print it)."""
    source = open(importlib.util.find_spec("this").origin, encoding="utf-8").read()
    encoded = source.split('s = """', 1)[1].split('"""', 1)[0]
    return codecs.decode(encoded, "rot13")


class ByteWindows(Dataset):
    """Windows of ``seq_len`` byte tokens, every ``stride`` bytes, as tokenized batches."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, stride: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len
        self.starts = list(range(0, len(tokens) - seq_len + 1, stride))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.tokens[self.starts[i]:self.starts[i] + self.seq_len]
        return {"input_ids": window, "attention_mask": torch.ones_like(window), "labels": window}


class TextData:
    """Byte-level windows of a text: the first 85% to train on, the rest to validate on.

    ``batch_size`` is what each loader yields (per replica with ``xla_fsdp``; the global batch,
    split over the devices, with ``xla_fsdpv2``)."""

    def __init__(self, path: str | None = None, seq_len: int = 64, stride: int = 4, batch_size: int = 8,
                 repeat: int = 4) -> None:
        text = zen_of_python() if path is None else open(path, encoding="utf-8").read()
        tokens = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
        cut = int(len(tokens) * 0.85)
        self.train = ByteWindows(tokens[:cut].repeat(repeat), seq_len, stride)
        self.val = ByteWindows(tokens[cut - seq_len:], seq_len, stride)
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        # shuffled in an order that the run's seed decides (no torch.Generator here: one cannot be
        # sent to the process that runs SPMD or several replicas)
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size, drop_last=True)


def main(argv: list[str]) -> dict[str, float]:
    """``xtrainer fit --config examples/tiny_llama.yaml *argv``; returns the final metrics."""
    from xtrainer.cli import run_stage
    from xtrainer.config import load

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:  # the configuration names examples.tiny_llama.*
        sys.path.insert(0, root)
    trainer, _ = run_stage("fit", load(["--config", CONFIG, *argv]))
    metrics = trainer.callback_metrics
    print(f"validation loss: {metrics['val_loss']:.4f}")
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
