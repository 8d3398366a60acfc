"""Checkpoints: full (unsharded) state dicts gathered on rank 0, written atomically.

A checkpoint is one ``torch.save`` file, ``<out>/checkpoints/step-NNNNNN.pt``, holding::

    {"format": "shardscale.train/1", "step": int, "model": {fqn: tensor},
     "optim": {"state": ..., "param_groups": ...}, "scaler": scaler.state_dict(),
     "scaler_kind": "shardscale/fp16", "meta": {"task", "hidden", "classes", ...},
     "run": {"steps", "lr", "weight_decay", "batch_size", "seed", "clip_grad_norm"}}

Model and optimizer states come from ``torch.distributed.checkpoint.state_dict.get_state_dict``
with ``full_state_dict=True`` (``cpu_offload=True`` on accelerators; works for FSDP2, FSDP1, DDP and plain modules);
the file is written to a temporary name in the same directory and renamed with ``os.replace``,
so an interrupted save never leaves a half-written checkpoint. On resume every rank reads the
file (on several nodes it must be on a shared file system) and loads it with ``set_state_dict``;
the scaler gets its exact scale, growth tracker and counters back through ``load_state_dict``.

``meta`` must match (else the weights do not fit); ``run`` may differ, but then the resumed run
is not the uninterrupted one (e.g. another ``--steps`` stretches the LR schedule), which
:func:`run_changes` reports. The scaler state moves between ``--scaler shardscale`` and
``--scaler torch`` (both read torch's five keys); it is not restored across a change of
fp16 (dynamic scale) to bf16/fp32 (guard, scale 1) or back (:func:`scaler_plan`).
"""

from __future__ import annotations

import os
import re
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .config import DEFAULT_GROWTH_INTERVAL, ConfigError

FORMAT = "shardscale.train/1"
_NAME = re.compile(r"step-(\d+)\.pt$")
#: Settings that shape the training trajectory without changing the model: recorded in each
#: checkpoint so that a resume with other values can say it is not the uninterrupted run.
RUN_KEYS = ("steps", "lr", "weight_decay", "batch_size", "seed", "clip_grad_norm", "policy",
            "growth_interval")  # fmt: skip


def path_for(out: str | Path, step: int) -> Path:
    """``<out>/checkpoints/step-NNNNNN.pt``."""
    return Path(out) / "checkpoints" / f"step-{step:06d}.pt"


def supersede_after(out: str | Path, step: int) -> tuple[Path, int] | None:
    """Move the checkpoints of ``out`` past ``step`` into ``checkpoints/superseded-<time>/``.

    A run that starts (or resumes) at ``step`` in a directory holding a previous history's later
    checkpoints replaces that history: ``metrics.jsonl`` is cut at ``step``, and the checkpoints
    must be too, or a later ``--resume <out>`` ("the latest") would continue the *old* run.
    Nothing is deleted. Returns ``(folder, count)``, or None when there was nothing to move.
    """
    d = Path(out) / "checkpoints"
    later = [
        f
        for f in (d.glob("step-*.pt") if d.is_dir() else [])
        if (m := _NAME.search(f.name)) and int(m.group(1)) > step
    ]
    if not later:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest, n = d / f"superseded-{stamp}", 1
    while dest.exists():  # two new histories in one second: never overwrite the first's files
        dest, n = d / f"superseded-{stamp}-{n}", n + 1
    dest.mkdir(parents=True)
    for f in later:
        f.rename(dest / f.name)
    return dest, len(later)


def resolve(path: str | Path) -> Path:
    """The checkpoint file named by ``--resume``: a file, or the latest ``step-N.pt`` of a run
    directory or of its ``checkpoints/`` directory.

    Raises:
        ConfigError: nothing there, or a directory without checkpoints.
    """
    p = Path(path)
    if p.is_file():
        return p
    if not p.is_dir():
        raise ConfigError(f"--resume {path}: no such file or directory.")
    for d in (p / "checkpoints", p):
        found = sorted(
            (f for f in d.glob("step-*.pt") if _NAME.search(f.name)),
            key=lambda f: int(_NAME.search(f.name).group(1)),
        )  # type: ignore[union-attr]
        if found:
            return found[-1]
    raise ConfigError(f"--resume {path}: no checkpoints/step-N.pt in this directory.")


def read(path: str | Path) -> dict[str, Any]:
    """Load and check a checkpoint file (``weights_only=True``: no code runs on load).

    Raises:
        ConfigError: unreadable, truncated or corrupt file, or not a shardscale checkpoint.
    """
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as e:  # permissions, I/O error (torch's zip errors are RuntimeErrors)
        raise ConfigError(f"--resume {path}: cannot read it ({e.strerror or e}).") from None
    except Exception:  # corrupt/truncated zip, a pickle weights_only refuses, not torch.save
        raise ConfigError(
            f"--resume {path}: not a readable shardscale checkpoint (corrupt, truncated, or "
            "not written by `shardscale train`)."
        ) from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ConfigError(
            f"--resume {path}: not a shardscale train checkpoint (no {FORMAT!r} format tag)."
        )
    missing = [k for k in ("step", "model", "optim", "scaler", "meta") if k not in ckpt]
    if missing or not isinstance(ckpt["step"], int) or ckpt["step"] < 1:
        raise ConfigError(
            f"--resume {path}: incomplete checkpoint (missing or bad {missing or ['step']})."
        )
    return ckpt


def check_compatible(
    ckpt: dict[str, Any], path: str | Path, meta: dict[str, Any], steps: int
) -> None:
    """Check that ``ckpt`` fits the model ``meta`` and that steps remain.

    Raises:
        ConfigError: a differing model setting (named), or ``ckpt["step"] >= steps``.
    """
    saved = ckpt["meta"]
    diff = [k for k in sorted(set(meta) | set(saved)) if meta.get(k) != saved.get(k)]
    if diff:
        what = ", ".join(f"{k}: saved {saved.get(k)!r:.40}, now {meta.get(k)!r:.40}" for k in diff)
        raise ConfigError(f"--resume {path}: the checkpoint is for another model ({what}).")
    if ckpt["step"] >= steps:
        raise ConfigError(
            f"--resume {path}: the checkpoint is at step {ckpt['step']} and --steps is {steps}; "
            "raise --steps to train further."
        )


def run_settings(cfg: Any) -> dict[str, Any]:
    """The :data:`RUN_KEYS` of a :class:`~shardscale.train.config.TrainConfig`."""
    return {k: getattr(cfg, k) for k in RUN_KEYS}


def resolve_policy(ckpt: dict[str, Any] | None, cfg: Any) -> str:
    """The loss-scale policy of the run: ``--policy`` when given; else, for ``--scaler
    shardscale`` in fp16, the policy of the resumed checkpoint's shardscale scaler state (a
    resume continues its rule); else ``"torch"``."""
    if cfg.policy is not None:
        return cfg.policy
    state = ckpt.get("scaler") if ckpt is not None else None
    saved = state.get("policy") if isinstance(state, dict) else None
    if cfg.scaler == "shardscale" and cfg.precision == "fp16" and saved in ("torch", "headroom"):
        return saved
    return "torch"


def resolve_growth_interval(ckpt: dict[str, Any] | None, cfg: Any) -> int:
    """``--growth-interval`` when given; else the resumed checkpoint's run's (its scaler
    state's for a checkpoint that does not record it); else the default, 50."""
    if cfg.growth_interval is not None:
        return cfg.growth_interval
    run, state = (ckpt.get("run"), ckpt.get("scaler")) if ckpt is not None else (None, None)
    for source in (run, state):
        value = source.get("growth_interval") if isinstance(source, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return DEFAULT_GROWTH_INTERVAL


def resolve_scaler_options(ckpt: dict[str, Any] | None, cfg: Any) -> None:
    """Fill in ``cfg.policy`` and ``cfg.growth_interval`` left to the checkpoint (or to their
    defaults for a fresh run): :func:`resolve_policy`, :func:`resolve_growth_interval`."""
    cfg.policy = resolve_policy(ckpt, cfg)
    cfg.growth_interval = resolve_growth_interval(ckpt, cfg)


def run_changes(ckpt: dict[str, Any], cfg: Any) -> list[str]:
    """The run settings of ``cfg`` that differ from the checkpoint's run, as option texts
    (e.g. ``"--steps 400 (checkpoint's run: 200)"``); empty for a checkpoint without them."""
    saved = ckpt.get("run")
    if not isinstance(saved, dict):
        return []
    now = {
        **run_settings(cfg),
        "policy": resolve_policy(ckpt, cfg),
        "growth_interval": resolve_growth_interval(ckpt, cfg),
    }
    keys = RUN_KEYS
    if "headroom" in (now["policy"], saved.get("policy")):  # no growth interval in its rule
        keys = tuple(k for k in RUN_KEYS if k != "growth_interval")
    return [
        f"--{k.replace('_', '-')} {now[k]} (checkpoint's run: {saved[k]})"
        for k in keys
        if k in saved and saved[k] != now[k]
    ]


def _scaler_mode(precision: str) -> str:
    return "dynamic" if precision == "fp16" else "guard"


def scaler_plan(ckpt: dict[str, Any], scaler_kind: str) -> tuple[bool, str]:
    """Whether the checkpoint's scaler state can be loaded into this run's scaler.

    ``scaler_kind`` is ``"<--scaler>/<--precision>"`` (e.g. ``"torch/fp16"``). The state moves
    between shardscale's and torch's scalers (torch's ``GradScaler`` and FSDP
    ``ShardedGradScaler`` read torch's five keys and ignore the others; shardscale accepts
    torch's five), and between the bf16/fp32 guards; not from fp16 (dynamic) to bf16/fp32
    (scale fixed at 1) or back.

    Returns:
        ``(True, note)`` (``note``: ``"from --scaler torch"`` across scalers, else empty), or
        ``(False, reason)`` with a reason for the summary, such as
        ``"checkpoint used --precision fp16"``.
    """
    scaler, precision = scaler_kind.split("/", 1)
    saved = ckpt.get("scaler_kind")
    if not isinstance(saved, str) or "/" not in saved:
        return False, "the checkpoint does not say which scaler wrote it"
    saved_scaler, saved_precision = saved.split("/", 1)
    if _scaler_mode(saved_precision) != _scaler_mode(precision):
        return False, f"checkpoint used --precision {saved_precision}"
    if not ckpt.get("scaler"):
        return False, (
            f"the checkpoint's scaler (--scaler {saved_scaler}, --precision {saved_precision}) "
            "was disabled"
        )
    if scaler == "torch" and precision != "fp16":
        return False, f"--scaler torch is disabled with --precision {precision}"
    return True, f"from --scaler {saved_scaler}" if saved_scaler != scaler else ""


def save(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    step: int,
    meta: dict[str, Any],
    scaler_kind: str,
    run: dict[str, Any] | None = None,
) -> None:
    """Gather full state dicts on rank 0 and write ``path`` atomically. Collective.

    ``scaler_kind`` (e.g. ``"shardscale/fp16"``) tells :func:`restore` whether the saved scaler
    state fits the scaler of the resumed run; ``run`` (:func:`run_settings`) lets a resume tell
    whether it continues the same run.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    # cpu_offload: gathered tensors land on the CPU (rank 0 only). Only for accelerators: with
    # parameters already on the CPU, FSDP1's offload path segfaults in torch 2.13.
    on_cpu = next(model.parameters()).device.type == "cpu"
    options = StateDictOptions(full_state_dict=True, cpu_offload=not on_cpu)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    scaler_sd = scaler.state_dict()  # collective-free; every rank holds the same state
    if _rank() != 0:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    ckpt = {
        "format": FORMAT,
        "step": step,
        "model": model_sd,
        "optim": optim_sd,
        "scaler": scaler_sd,
        "scaler_kind": scaler_kind,
        "meta": meta,
        "run": run or {},
    }
    try:
        torch.save(ckpt, tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def restore(
    ckpt: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    cfg: Any,
) -> tuple[int, bool, str]:
    """Load a checkpoint (read by every rank) into the model, optimizer and scaler. Collective.

    The scaler state is loaded (:func:`load_scaler`) when :func:`scaler_plan` allows it (also
    from the other ``--scaler``); otherwise the scaler starts afresh at its initial scale.

    Returns:
        The step the checkpoint was taken at, whether the scaler state was loaded, and the
        note of :func:`scaler_plan` (why not, or from which scaler).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(
        model,
        optimizer,
        model_state_dict=ckpt["model"],
        optim_state_dict=ckpt["optim"],
        options=StateDictOptions(full_state_dict=True),
    )
    loaded, why = scaler_plan(ckpt, f"{cfg.scaler}/{cfg.precision}")
    if loaded:
        load_scaler(scaler, ckpt, cfg)
    return int(ckpt["step"]), loaded, why


#: The scaler's warning that a resume changes the checkpoint's policy and nothing else:
#: :func:`run_changes` says it in the command line's terms.
_POLICY_ONLY = (
    r"load_state_dict\(\) keeps the policy the constructor asked for: policy='\w+' "
    r"\(the checkpoint's: '\w+'\); the scale"
)


def load_scaler(scaler: Any, ckpt: dict[str, Any], cfg: Any) -> None:
    """Load the checkpoint's scaler state into this run's ``scaler`` as the command line
    says: under torch's rule in fp16 ``--growth-interval`` replaces the state's (torch's
    ``load_state_dict`` takes the state's interval; a change is one of :func:`run_changes`,
    as a change of ``--policy`` is, whose warning from the scaler is left out)."""
    state = ckpt["scaler"]
    if cfg.precision == "fp16" and cfg.policy == "torch" and "growth_interval" in state:
        state = {**state, "growth_interval": cfg.growth_interval}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_POLICY_ONLY)
        scaler.load_state_dict(state)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
