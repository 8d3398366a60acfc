"""Models: an MLP for the digits and a small character-level transformer for ``--text``.

Each model lists its ``shard_units()``: the submodules that FSDP shards on their own (as
torchtitan shards each transformer block, then the root).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import TrainConfig
from .data import Dataset


class DigitsMLP(nn.Module):
    """64 -> hidden -> hidden -> 10 with GELU; input float ``[B, 64]``, logits ``[B, 10]``."""

    def __init__(self, hidden: int, num_classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits in the compute dtype (FSDP casts the input to the parameter dtype)."""
        return self.head(F.gelu(self.fc2(F.gelu(self.fc1(x)))))

    def shard_units(self) -> list[nn.Module]:
        """Submodules sharded separately by FSDP."""
        return [self.fc1, self.fc2]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention (4 heads) and a 4x GELU MLP."""

    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[B, T, dim]`` -> ``[B, T, dim]``."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharTransformer(nn.Module):
    """A GPT-style character model: ids ``[B, T]`` (int64) -> logits ``[B * T, vocab]``."""

    def __init__(self, vocab: int, dim: int, layers: int, seq_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Next-character logits for every position, flattened to ``[B * T, vocab]`` (a fresh
        tensor, not a view: FSDP2 cannot hook a view output)."""
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x).flatten(0, 1))

    def shard_units(self) -> list[nn.Module]:
        """Submodules sharded separately by FSDP (one per transformer block)."""
        return list(self.blocks)


def build(cfg: TrainConfig, data: Dataset) -> nn.Module:
    """The fp32 model of ``cfg``, initialized from ``cfg.seed`` (identical on every rank)."""
    torch.manual_seed(cfg.seed)
    assert cfg.hidden is not None
    if data.task == "text":
        return CharTransformer(data.num_classes, cfg.hidden, cfg.layers, cfg.seq_len)
    return DigitsMLP(cfg.hidden, data.num_classes)


def describe(cfg: TrainConfig, data: Dataset) -> dict[str, object]:
    """What a checkpoint must match to be loaded into this model."""
    meta: dict[str, object] = {"task": data.task, "hidden": cfg.hidden, "classes": data.num_classes}
    if data.task == "text":
        meta.update(layers=cfg.layers, seq_len=cfg.seq_len, vocab=data.vocab)
    return meta
