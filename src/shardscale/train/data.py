"""Data: scikit-learn's bundled digits (no download) or any UTF-8 text file, split across ranks.

Batches are a pure function of ``(seed, step)``: every rank draws the same global batch and keeps
its own contiguous slice of it, and a resumed run sees exactly the batches the uninterrupted run
would have seen.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import numpy as np
import torch

from .config import TrainConfig, check_text_file


@dataclasses.dataclass
class Dataset:
    """Tensors of one task, on the CPU.

    Attributes:
        task: ``"digits"`` or ``"text"``.
        train_x, train_y: digits: float32 ``[N, 64]`` standardized pixels and int64 ``[N]``
            labels; text: int64 ``[T]`` character ids (``train_y`` unused, empty).
        test_x, test_y: the held-out part, same layout.
        num_classes: 10 for digits, the vocabulary size for text.
        vocab: the characters of the text file, sorted (empty for digits).
    """

    task: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    vocab: str = ""


def load(cfg: TrainConfig) -> Dataset:
    """Load the dataset of ``cfg`` (digits, or ``cfg.text``).

    Digits: 1797 8x8 images, a fixed stratified 75/25 split (numpy seed 0), features
    standardized with the training set's mean and std. Text: characters sorted into a vocabulary,
    the first 90% for training, the last 10% for evaluation.

    Raises:
        ConfigError: the text file is missing, not UTF-8 or too short.
    """
    if cfg.text:
        return _load_text(check_text_file(cfg.text, cfg.seq_len))
    x, y = load_digits()
    test = _stratified_test_mask(y, 0.25, seed=0)
    x_tr, y_tr, x_te, y_te = x[~test], y[~test], x[test], y[test]
    mean, std = x_tr.mean(axis=0), x_tr.std(axis=0) + 1e-3
    to_x = lambda a: torch.tensor((a - mean) / std, dtype=torch.float32)  # noqa: E731
    to_y = lambda a: torch.tensor(a, dtype=torch.int64)  # noqa: E731
    return Dataset("digits", to_x(x_tr), to_y(y_tr), to_x(x_te), to_y(y_te), 10)


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits: float64 ``[1797, 64]`` pixels (0..16), int64 ``[1797]``.

    Reads the ``digits.csv.gz`` that scikit-learn ships (what ``sklearn.datasets.load_digits``
    reads) without importing scikit-learn, which takes seconds in every rank; falls back to
    ``load_digits`` if the file is not where it has always been.
    """
    spec = importlib.util.find_spec("sklearn")
    roots = list(spec.submodule_search_locations or []) if spec else []
    for root in roots:
        path = os.path.join(root, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            table = np.loadtxt(path, delimiter=",")
            if table.shape == (1797, 65):
                return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits as sklearn_load_digits

    x, y = sklearn_load_digits(return_X_y=True)
    return x.astype(np.float64), y.astype(np.int64)


def _stratified_test_mask(y: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """A fixed stratified split: ``round(fraction * n_c)`` random samples of each class."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(len(y), dtype=bool)
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        mask[rng.permutation(idx)[: round(fraction * len(idx))]] = True
    return mask


def _load_text(text: str) -> Dataset:
    vocab = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.int64)
    cut = int(len(ids) * 0.9)
    empty = torch.empty(0, dtype=torch.int64)
    return Dataset("text", ids[:cut], empty, ids[cut:], empty, len(vocab), vocab)


class Batches:
    """The training batches of one rank: ``batches.get(step)`` for 1-based ``step``.

    Digits: epochs of a seeded permutation (drop last); global batch ``b`` of step ``s`` is the
    ``s``-th slice of ``batch_size`` indices. Text: ``batch_size`` random windows of
    ``seq_len + 1`` characters drawn with a generator seeded by ``(seed, step)``. The rank keeps
    rows ``[rank * B / world, (rank + 1) * B / world)`` of the global batch.
    """

    def __init__(self, data: Dataset, cfg: TrainConfig, rank: int, world: int) -> None:
        self.data, self.cfg = data, cfg
        per_rank = cfg.batch_size // world
        self.rows = slice(rank * per_rank, (rank + 1) * per_rank)
        self._epoch: tuple[int, torch.Tensor] | None = None

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(input, target)`` for ``step`` (CPU tensors).

        Digits: float32 ``[B/world, 64]`` and int64 ``[B/world]``. Text: int64
        ``[B/world, seq_len]`` inputs and the int64 next-character targets of the same shape.
        """
        cfg, data = self.cfg, self.data
        if data.task == "text":
            g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
            starts = torch.randint(
                0, len(data.train_x) - cfg.seq_len - 1, (cfg.batch_size,), generator=g
            )[self.rows]
            return _windows(data.train_x, starts, cfg.seq_len)
        n = len(data.train_x)
        per_epoch = max(n // cfg.batch_size, 1)
        epoch, i = divmod(step - 1, per_epoch)
        if self._epoch is None or self._epoch[0] != epoch:
            g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
            self._epoch = (epoch, torch.randperm(n, generator=g))
        idx = self._epoch[1][i * cfg.batch_size : (i + 1) * cfg.batch_size][self.rows]
        return data.train_x[idx], data.train_y[idx]


def _windows(
    ids: torch.Tensor, starts: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.arange(seq_len + 1)
    chunk = ids[starts[:, None] + offsets[None, :]]
    return chunk[:, :-1], chunk[:, 1:]


def eval_shard(
    data: Dataset, cfg: TrainConfig, rank: int, world: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of the held-out set, as a list of ``(input, target)`` batches.

    Every rank gets the same number of batches (FSDP needs all ranks in every forward); padding
    rows carry target -100 and are ignored by the loss and the accuracy.
    Digits: the whole test set. Text: up to 256 non-overlapping windows of the held-out text.
    """
    if data.task == "text":
        n_win = min(256, (len(data.test_x) - 1) // cfg.seq_len)
        starts = torch.arange(n_win) * cfg.seq_len
        x, y = _windows(data.test_x, starts, cfg.seq_len)
    else:
        x, y = data.test_x, data.test_y
    per_rank = -(-len(x) // world)
    pad = per_rank * world - len(x)
    if pad:
        x = torch.cat([x, x[:pad]])
        y = torch.cat([y, torch.full((pad, *y.shape[1:]), -100, dtype=y.dtype)])
    x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
    size = 256 if data.task == "digits" else 32
    return [(x[i : i + size], y[i : i + size]) for i in range(0, per_rank, size)]
