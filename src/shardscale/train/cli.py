"""``shardscale train``: validate the options, then start the ranks with torch's elastic launcher.

The parent process checks everything it can before any worker starts (options, ``--text`` file,
``--resume`` checkpoint, ``--device cuda``), so bad input costs no launch and ends with one line
on stderr and exit code 2. It then runs ``python -m shardscale.train.worker`` on ``--nproc`` local
ranks with ``torch.distributed.launcher.api.elastic_launch`` (what ``torchrun --standalone``
does: c10d rendezvous on a free localhost port, no restarts). A failing worker is reported as
one line (its error, read from torch elastic's error file) with its exit code.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

from .config import ConfigError, TrainConfig, parse, validate
from .worker import PREFIX, one_line

WORKER_MODULE = "shardscale.train.worker"


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``shardscale train`` / ``python -m shardscale train``.

    Args:
        argv: the options after ``train`` (``sys.argv[1:]`` if None).

    Returns:
        0 on success; 2 for bad input (options, files, checkpoint) or a collapsed loss scale;
        1 when a worker fails otherwise; 130 when interrupted.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = parse(argv)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except ConfigError as e:
        return _error(str(e), 2)
    try:
        extra = _prepare(cfg)
    except ConfigError as e:
        return _error(str(e), 2)
    return launch(cfg, argv + extra)


def _prepare(cfg: TrainConfig) -> list[str]:
    """Validate ``cfg`` in the parent; return the options that pin down what workers must agree
    on (the resolved ``--out``, ``--nproc`` and ``--resume`` file).

    Raises:
        ConfigError: any bad input.
    """
    out_given = cfg.out is not None
    validate(cfg)
    extra = ["--nproc", str(cfg.nproc)]
    if cfg.resume:
        from . import checkpoint, data, model

        path = checkpoint.resolve(cfg.resume)
        ckpt = checkpoint.read(path)
        checkpoint.check_compatible(ckpt, path, model.describe(cfg, data.load(cfg)), cfg.steps)
        checkpoint.resolve_scaler_options(ckpt, cfg)  # as the workers do
        _check_scaler_state(ckpt, path, cfg)
        changes = checkpoint.run_changes(ckpt, cfg)
        if changes:
            why = (
                " (the LR warm-up and cosine span --steps)"
                if any(c.startswith("--steps ") for c in changes)
                else ""
            )
            _warn(
                f"--resume {path}: {', '.join(changes)}: this is not the checkpoint's run "
                f"continued{why}; it will not match an uninterrupted run bit for bit."
            )
        if not out_given:
            run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
            cfg.out = str(run_dir)
        extra += ["--resume", str(path)]
    try:
        Path(cfg.out).mkdir(parents=True, exist_ok=True)  # type: ignore[arg-type]
    except OSError as e:
        raise ConfigError(f"--out {cfg.out}: cannot create it ({e.strerror}).") from None
    if not os.access(cfg.out, os.W_OK):  # type: ignore[arg-type]
        raise ConfigError(f"--out {cfg.out}: not writable.")
    return extra + ["--out", str(cfg.out)]


def _check_scaler_state(ckpt: dict, path: Path, cfg: TrainConfig) -> None:
    """Load the checkpoint's scaler state into a CPU copy of this run's scaler, if it is to be
    restored, so that a bad state fails here (exit 2) rather than in every worker."""
    import torch

    from . import checkpoint, parallel

    restore, _ = checkpoint.scaler_plan(ckpt, f"{cfg.scaler}/{cfg.precision}")
    if not restore:
        return
    try:
        checkpoint.load_scaler(parallel.make_scaler(cfg, torch.device("cpu")), ckpt, cfg)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        what = f"missing key {e}" if isinstance(e, KeyError) else str(e)
        raise ConfigError(
            f"--resume {path}: its scaler state does not load ({what.rstrip('.')})."
        ) from None


def launch(cfg: TrainConfig, worker_argv: list[str]) -> int:
    """Run ``python -m shardscale.train.worker WORKER_ARGV`` on ``cfg.nproc`` local ranks.

    Uses ``elastic_launch`` with a standalone c10d rendezvous (``localhost:0``), no restarts, and
    torch elastic's per-rank error files (kept in a temporary directory, removed afterwards).

    Returns:
        0, or the exit code of the failing worker (2 for bad input/collapse, 1 otherwise).
    """
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    log_dir = tempfile.mkdtemp(prefix="shardscale-train-")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.nproc,  # type: ignore[arg-type]
        run_id=f"shardscale-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )
    os.environ["SHARDSCALE_TRAIN_LAUNCHER"] = "1"
    try:
        elastic_launch(config, sys.executable)("-m", WORKER_MODULE, *worker_argv)
        return 0
    except ChildFailedError as e:
        message, code = _root_cause(e)
        return _error(message, code)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # rendezvous/agent failure (e.g. SignalException on Ctrl-C)
        if type(e).__name__ == "SignalException":
            return 130
        return _error(f"the launcher failed: {type(e).__name__}: {e}", 1)
    finally:
        os.environ.pop("SHARDSCALE_TRAIN_LAUNCHER", None)
        shutil.rmtree(log_dir, ignore_errors=True)


_PEER_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _root_cause(err: object) -> tuple[str, int]:
    """The one failure worth printing: an exit-2 message (bad input/collapse, seen by every
    rank), else the earliest error that is not a peer hanging up, else a signal."""
    failures = sorted(err.failures.items())  # type: ignore[attr-defined]
    with_msg = [
        (r, f)
        for r, f in failures
        if isinstance(f.error_file_data.get("message"), str) and f.error_file_data["message"]
    ]
    for _, f in with_msg:
        if f.exitcode == 2:
            return f.message, 2
    own = [
        (f.timestamp, r, f) for r, f in with_msg if not any(p in f.message for p in _PEER_ERRORS)
    ]
    if own or with_msg:
        _, _, f = min(own) if own else (0, 0, with_msg[0][1])
        return f.message, f.exitcode if f.exitcode > 0 else 1
    # the launcher SIGTERMs the other ranks once one fails: the root cause is another signal
    signalled = [(r, f) for r, f in failures if f.exitcode < 0]
    rank, f = next(((r, f) for r, f in signalled if f.signal_name() != "SIGTERM"), failures[0])
    if f.exitcode < 0:
        return f"rank {rank} died from signal {f.signal_name()} (see the lines above)", 1
    return f"rank {rank} exited with code {f.exitcode} and no message", f.exitcode or 1


def _warn(message: str) -> None:
    print(PREFIX.replace("error", "warning") + one_line(message), file=sys.stderr, flush=True)


def _error(message: str, code: int) -> int:
    print(PREFIX + one_line(message), file=sys.stderr, flush=True)
    return code
