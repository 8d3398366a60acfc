"""Options of ``shardscale train``: one argparse parser shared by the launcher and the workers.

The parent process (:mod:`shardscale.train.cli`) parses and validates the options before any
worker starts; each worker (:mod:`shardscale.train.worker`, also run directly by ``torchrun``)
parses the same argument list again, so both always agree on the configuration.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from pathlib import Path

import torch

PARALLEL = ("fsdp2", "fsdp1", "ddp", "none")
PRECISION = ("fp16", "bf16", "fp32")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


class ConfigError(ValueError):
    """A bad option or input file; the message names it and is printed as one line (exit 2)."""


#: ``--growth-interval`` of a fresh run.
DEFAULT_GROWTH_INTERVAL = 50


@dataclasses.dataclass
class TrainConfig:
    """The parsed options of ``shardscale train`` (see ``shardscale train --help``).

    ``nproc`` and ``hidden`` may be None after parsing; :func:`validate` fills them in.
    """

    nproc: int | None = None
    device: str = "cpu"
    parallel: str = "fsdp2"
    precision: str = "fp16"
    reduce_dtype: str = "fp32"
    scaler: str = "shardscale"
    policy: str | None = None  # None: a resumed shardscale checkpoint's, else "torch"
    init_scale: float = 2.0**20
    growth_interval: int | None = None  # None: a resumed checkpoint's, else 50
    max_consecutive_skips: int | None = 20
    steps: int = 400
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 0.01
    clip_grad_norm: float | None = None
    hidden: int | None = None
    layers: int = 2
    seq_len: int = 64
    text: str | None = None
    seed: int = 0
    log_every: int = 10
    ckpt_every: int = 0
    out: str | None = None
    resume: str | None = None
    progress: bool = True
    inject_inf_step: list[int] = dataclasses.field(default_factory=list)

    @property
    def task(self) -> str:
        """``"text"`` (character-level transformer) or ``"digits"`` (MLP on sklearn digits)."""
        return "text" if self.text else "digits"

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype of ``--precision``."""
        return DTYPES[self.precision]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        if "**" in text:
            base, exponent = text.split("**", 1)
            value = float(base) ** float(exponent)
        else:
            value = float(text)
    except Exception:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` except for flags and None/empty defaults (the help says those)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default == [] or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse, but errors raise :class:`ConfigError` (one line) instead of printing usage."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    """The ``shardscale train`` argument parser (errors raise :class:`ConfigError`)."""
    d = TrainConfig()
    p = _Parser(
        prog="shardscale train",
        description=(
            "Train a small model in fp16 with sharded data parallelism over several processes "
            "(torch elastic launcher, gloo on CPU / NCCL on CUDA), with shardscale's "
            "ShardedGradScaler adapting the loss scale. Writes metrics.jsonl, loss_scale.png, "
            "summary.json and checkpoints/step-N.pt to --out."
        ),
        formatter_class=_HelpFormatter,
    )
    g = p.add_argument_group("processes")
    g.add_argument(
        "--nproc",
        type=_positive_int,
        default=None,
        help="local worker processes (default 2; 1 with --parallel none)",
    )
    g.add_argument(
        "--device",
        choices=("cpu", "cuda", "auto"),
        default=d.device,
        help="cpu (gloo) or cuda (NCCL, one GPU per process); auto picks cuda if present",
    )
    g.add_argument(
        "--parallel",
        choices=PARALLEL,
        default=d.parallel,
        help="fsdp2: fully_shard + MixedPrecisionPolicy; fsdp1: FullyShardedDataParallel; "
        "ddp: DistributedDataParallel + autocast; none: one process, autocast",
    )
    g = p.add_argument_group("precision and loss scaling")
    g.add_argument(
        "--precision",
        choices=PRECISION,
        default=d.precision,
        help="parameter/compute dtype (master weights and optimizer stay fp32)",
    )
    g.add_argument(
        "--reduce-dtype",
        choices=PRECISION,
        default=d.reduce_dtype,
        help="dtype of the gradient reduction (FSDP reduce_dtype; DDP compress hook)",
    )
    g.add_argument(
        "--scaler",
        choices=("shardscale", "torch"),
        default=d.scaler,
        help="shardscale.ShardedGradScaler, or torch's own scaler for the set-up "
        "(torch.amp.GradScaler; FSDP1: torch's ShardedGradScaler)",
    )
    g.add_argument(
        "--policy",
        choices=("torch", "headroom"),
        default=d.policy,
        help="shardscale, fp16: how the scale moves: torch's rule (growth after "
        "--growth-interval clean steps) or 'headroom' (from the measured gradient amax, "
        "docs/headroom.md); default: a resumed checkpoint's, else torch",
    )
    g.add_argument(
        "--init-scale",
        type=_positive_float,
        default=d.init_scale,
        help="initial loss scale (fp16); '2**20' is accepted",
    )
    g.add_argument(
        "--growth-interval",
        type=_positive_int,
        default=d.growth_interval,
        help="clean steps before the scale doubles (--policy torch); default: a resumed "
        f"checkpoint's, else {DEFAULT_GROWTH_INTERVAL}",
    )
    g.add_argument(
        "--max-consecutive-skips",
        type=_nonneg_int,
        default=d.max_consecutive_skips,
        help="shardscale only: this many skipped steps in a row stop the run "
        "(ScaleCollapseError, exit 2); 0 disables",
    )
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=_positive_int, default=d.steps, help="total optimizer steps")
    g.add_argument(
        "--batch-size",
        type=_positive_int,
        default=d.batch_size,
        help="global batch (split evenly across ranks)",
    )
    g.add_argument("--lr", type=_positive_float, default=d.lr, help="AdamW peak learning rate")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay")
    g.add_argument(
        "--clip-grad-norm",
        type=_positive_float,
        default=None,
        help="clip the global gradient norm to this value (default: off)",
    )
    g.add_argument("--seed", type=int, default=d.seed, help="model init and data order")
    g = p.add_argument_group("model and data")
    g.add_argument(
        "--text",
        default=None,
        metavar="FILE",
        help="train a character-level transformer on this UTF-8 text file "
        "(default: an MLP on scikit-learn's bundled digits)",
    )
    g.add_argument(
        "--hidden",
        type=_positive_int,
        default=None,
        help="MLP width (default 256) or transformer width (default 128)",
    )
    g.add_argument("--layers", type=_positive_int, default=d.layers, help="transformer blocks")
    g.add_argument(
        "--seq-len",
        type=_positive_int,
        default=d.seq_len,
        help="transformer context length (characters)",
    )
    g = p.add_argument_group("output")
    g.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="output directory (default runs/<timestamp>; with --resume, the run's)",
    )
    g.add_argument(
        "--resume",
        default=None,
        metavar="PATH",
        help="continue from a checkpoint: a run directory (latest checkpoint), its "
        "checkpoints/ directory or a step-N.pt file",
    )
    g.add_argument(
        "--ckpt-every",
        type=_nonneg_int,
        default=d.ckpt_every,
        help="also checkpoint every N steps (0: only at the end)",
    )
    g.add_argument(
        "--log-every",
        type=_positive_int,
        default=d.log_every,
        help="read losses/scales back to the host every N steps",
    )
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    g.add_argument(
        "--inject-inf-step",
        type=_positive_int,
        action="append",
        default=[],
        metavar="K",
        help="debug: put an inf into one gradient shard of the last rank at step K "
        "(repeatable) to force an overflow",
    )
    return p


def parse(argv: list[str]) -> TrainConfig:
    """Parse ``argv`` into a :class:`TrainConfig` (not yet validated).

    Raises:
        ConfigError: an unknown option or a bad value.
    """
    ns = build_parser().parse_args(argv)
    cfg = TrainConfig(**vars(ns))
    if cfg.max_consecutive_skips == 0:
        cfg.max_consecutive_skips = None
    return cfg


def validate(cfg: TrainConfig, world_size: int | None = None) -> TrainConfig:
    """Check the options against each other and the machine; fill in defaults. In place.

    Args:
        cfg: parsed options.
        world_size: the total number of ranks if already known (under torchrun), else
            ``cfg.nproc``.

    Returns:
        ``cfg``, with ``nproc``, ``hidden``, ``device`` and ``out`` resolved.

    Raises:
        ConfigError: the message names the option and the fix.
    """
    if cfg.nproc is None:
        cfg.nproc = 1 if cfg.parallel == "none" else 2
    world = world_size or cfg.nproc
    if cfg.parallel == "none" and world != 1:
        raise ConfigError(
            f"--parallel none trains one process, but {world} were asked for; "
            "use --nproc 1 or a parallel mode (fsdp2, fsdp1, ddp)."
        )
    if cfg.device == "auto":
        cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                "--device cuda: CUDA is not available on this machine; use --device cpu."
            )
        if world_size is None and cfg.nproc > torch.cuda.device_count():
            raise ConfigError(
                f"--nproc {cfg.nproc} needs one GPU per process, but only "
                f"{torch.cuda.device_count()} are visible; lower --nproc."
            )
    if cfg.parallel == "ddp" and cfg.reduce_dtype == "bf16" and cfg.device == "cpu":
        # torch's bf16_compress_hook needs CUDA+NCCL (or XPU+XCCL); gloo on CPU refuses it
        raise ConfigError(
            "--parallel ddp --reduce-dtype bf16 needs CUDA/NCCL (torch's bf16 compress hook); "
            "on the CPU use --reduce-dtype fp32 or fp16, or --parallel fsdp2."
        )
    if cfg.batch_size % world:
        raise ConfigError(
            f"--batch-size {cfg.batch_size} does not split evenly over {world} ranks; "
            f"use a multiple of {world}."
        )
    if cfg.hidden is None:
        cfg.hidden = 128 if cfg.text else 256
    if cfg.text:
        if cfg.hidden % 4:
            raise ConfigError(f"--hidden {cfg.hidden} must be a multiple of 4 (4 attention heads).")
        check_text_file(cfg.text, cfg.seq_len)
    if cfg.policy == "headroom" and cfg.scaler != "shardscale":
        raise ConfigError(f"--policy {cfg.policy} needs --scaler shardscale (torch's has none).")
    if cfg.policy == "headroom" and cfg.precision != "fp16":
        raise ConfigError(
            f"--policy {cfg.policy} needs --precision fp16: {cfg.precision} trains without a "
            "loss scale (the scaler's guard)."
        )
    check_scaler_options(cfg)
    if not (math.isfinite(cfg.weight_decay) and cfg.weight_decay >= 0):
        raise ConfigError(f"--weight-decay must be a finite number >= 0, got {cfg.weight_decay}.")
    for step in cfg.inject_inf_step:
        if step > cfg.steps:
            raise ConfigError(f"--inject-inf-step {step} is beyond --steps {cfg.steps}.")
    if cfg.out is None:
        cfg.out = str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    if Path(cfg.out).exists() and not Path(cfg.out).is_dir():
        raise ConfigError(f"--out {cfg.out} exists and is not a directory.")
    return cfg


_SCALER_OPTIONS = {
    "init_scale": "--init-scale",
    "growth_interval": "--growth-interval",
    "max_consecutive_skips": "--max-consecutive-skips",
    "policy": "--policy",
}


def check_scaler_options(cfg: TrainConfig) -> None:
    """Check the loss-scaling options the way the workers' scaler will, before any launch.

    Builds (and drops) a CPU :class:`shardscale.ShardedGradScaler` with ``--init-scale``,
    ``--growth-interval`` and ``--max-consecutive-skips``: the same checks as in the workers
    (e.g. the scale must lie in ``[2**-126, 2**127]`` so that it and its inverse are finite in
    float32). Applies to ``--scaler torch`` too: its float32 scale has the same range.

    Raises:
        ConfigError: the option and the scaler's reason.
    """
    from shardscale import ShardedGradScaler

    values = {name: getattr(cfg, name) for name in _SCALER_OPTIONS}
    if values["growth_interval"] is None:  # resolved later (checkpoint.resolve_scaler_options)
        values["growth_interval"] = DEFAULT_GROWTH_INTERVAL
    if cfg.policy == "headroom":
        del values["growth_interval"]  # unused there: the workers' scaler is built without it
    try:
        ShardedGradScaler("cpu", **values)
    except (TypeError, ValueError) as e:
        reason = str(e)
        name = next((n for n in _SCALER_OPTIONS if reason.startswith(n)), None)
        if name is None:
            raise ConfigError(f"bad loss-scaling option: {reason}") from None
        value = values[name]
        if isinstance(value, float):
            exp = math.frexp(value)[1] - 1
            shown = f"2**{exp}" if value == 2.0**exp else f"{value:g}"
        else:
            shown = str(value)
        # shardscale train has no --min-scale/--max-scale: only the value can change
        reason = reason.replace("; change the value or the bounds.", ".")
        if name == "init_scale" and "lies outside" in reason:  # the bounds are the defaults
            reason = (
                "must lie in [2**-126, 2**127], where the scale and its inverse are finite "
                "float32 numbers."
            )
        raise ConfigError(f"{_SCALER_OPTIONS[name]} {shown}: {reason}") from None


def check_text_file(path: str, seq_len: int) -> str:
    """Read a ``--text`` file: it must exist, be UTF-8 and hold ``10 * (seq_len + 1)`` chars.

    (The last 10% is held out for evaluation and must hold at least one window.)

    Returns:
        The decoded text.

    Raises:
        ConfigError: the file is missing, unreadable, not UTF-8 or too short.
    """
    if not os.path.isfile(path):
        raise ConfigError(f"--text {path}: no such file.")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"--text {path}: not UTF-8 text ({e.reason} at byte {e.start})."
        ) from None
    except OSError as e:
        raise ConfigError(f"--text {path}: cannot read it ({e.strerror}).") from None
    need = 10 * (seq_len + 1) + 1
    if len(text) < need:
        raise ConfigError(
            f"--text {path}: {len(text)} characters is too short for --seq-len {seq_len} "
            f"(needs at least {need}); use a longer file or a smaller --seq-len."
        )
    return text
