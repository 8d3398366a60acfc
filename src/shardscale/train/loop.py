"""The training loop of one rank: AMP recipe with a loss scaler, metrics, checkpoints, eval.

Per step::

    loss = cross_entropy(model(x).float(), y)      # fp16 compute (FSDP params or autocast)
    scaler.scale(loss).backward()                  # FSDP reduce-scatters grads in fp32
    [scaler.clip_grad_norm_(...)]                  # optional
    scaler.step(optimizer); scaler.update()        # agreed skip on every rank, scale adapts

Host reads are batched: the loss, the scale used and the skip flag of each step stay tensors and
are read back (with one all-reduce of the losses) every ``--log-every`` steps.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardscale import ScaleCollapseError, ShardedGradScaler

from . import checkpoint, data, model, parallel, report
from .config import TrainConfig


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up over the first 5% of the steps, then cosine decay to 10% of ``cfg.lr``."""
    warm = max(1, cfg.steps // 20)
    if step <= warm:
        return cfg.lr * step / warm
    progress = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def _loss(logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        target.reshape(-1),
        ignore_index=-100,
        reduction=reduction,
    )


def _scale_tensor(scaler: Any, device: torch.device) -> torch.Tensor:
    """The current scale as a 0-d float32 tensor, copied without a host sync (1.0 if disabled).

    ``_get_scale_async`` is the scale accessor both torch's scalers and shardscale's provide.
    """
    scale = scaler._get_scale_async() if scaler.is_enabled() else None
    return torch.ones((), device=device) if scale is None else scale.detach().clone().reshape(())


class _Recorder:
    """Keeps per-step tensors and turns them into metrics rows every ``--log-every`` steps."""

    def __init__(self, cfg: TrainConfig, rank: int, world: int, start: int) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.rows: list[dict[str, Any]] = []
        self.writer = report.MetricsWriter(cfg.out, start) if rank == 0 else None  # type: ignore[arg-type]
        # the checkpoints of a previous history past `start` go with its metrics rows
        self.superseded = checkpoint.supersede_after(cfg.out, start) if rank == 0 else None  # type: ignore[arg-type]

    def add(
        self, step: int, loss: torch.Tensor, scale: torch.Tensor, skipped: torch.Tensor
    ) -> None:
        self.pending.append((step, loss.detach().float(), scale, skipped.float().to(loss.device)))

    def flush(self) -> list[dict[str, Any]]:
        """One all-reduce and one host read for all pending steps. Collective."""
        if not self.pending:
            return []
        k = len(self.pending)
        local = torch.cat(
            [torch.stack([p[1] for p in self.pending]), torch.stack([p[3] for p in self.pending])]
        )
        total = local.clone()
        if self.world > 1:
            dist.all_reduce(total)
        scales = torch.stack([p[2].to(total.device) for p in self.pending])
        host = torch.cat([total, local[k:], scales]).tolist()
        rows = [
            {
                "step": p[0],
                "loss": host[i] / self.world,
                "scale": host[3 * k + i],
                "skipped": bool(host[2 * k + i]),
                "ranks_skipped": int(host[k + i]),
            }
            for i, p in enumerate(self.pending)
        ]
        self.pending = []
        self.rows += rows
        if self.writer is not None:
            self.writer.write(rows)
        return rows


def train(cfg: TrainConfig, rank: int, world: int, device: torch.device) -> dict[str, Any] | None:
    """Train on this rank; return the summary on rank 0 (None elsewhere).

    Collective: every rank of the default process group runs it with the same ``cfg``.

    Raises:
        ScaleCollapseError: the loss scale collapsed (after writing the metrics and the plot);
            the message names the training step (counted from 1, as in ``metrics.jsonl``).
        ConfigError: a bad ``--text`` file or ``--resume`` checkpoint (checked on every rank).
    """
    dataset = data.load(cfg)
    meta = model.describe(cfg, dataset)
    ckpt, path = None, None
    if cfg.resume:
        path = checkpoint.resolve(cfg.resume)
        ckpt = checkpoint.read(path)  # every rank reads it: the path must be visible to all nodes
        checkpoint.check_compatible(ckpt, path, meta, cfg.steps)
    checkpoint.resolve_scaler_options(ckpt, cfg)  # the summary, the plot and checkpoints
    net = parallel.wrap(model.build(cfg, dataset), cfg, device)
    optimizer = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scaler = parallel.make_scaler(cfg, device)
    if isinstance(scaler, ShardedGradScaler):
        scaler.set_param_names(net)
    scaler_kind = f"{cfg.scaler}/{cfg.precision}"
    run = checkpoint.run_settings(cfg)
    start, scaler_loaded, scaler_note, changes = 0, False, "", []
    if ckpt is not None:
        start, scaler_loaded, scaler_note = checkpoint.restore(ckpt, net, optimizer, scaler, cfg)
        changes = checkpoint.run_changes(ckpt, cfg)
        del ckpt
    # ScaleCollapseError counts scaler updates from 0; training steps count from 1 (metrics.jsonl)
    offset = start + 1 - _scaler_steps(scaler)
    batches = data.Batches(dataset, cfg, rank, world)
    rec = _Recorder(cfg, rank, world, start)
    amp = parallel.autocast(cfg, device)
    inject = set(cfg.inject_inf_step)
    bar = _progress(cfg, rank, start)
    net.train()
    train_time, saves = 0.0, 0.0
    t0 = time.perf_counter()
    try:
        for step in range(start + 1, cfg.steps + 1):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(cfg, step)
            x, y = (t.to(device, non_blocking=True) for t in batches.get(step))
            with amp:
                logits = net(x)
            loss = _loss(logits, y)
            scaled = scaler.scale(loss)
            scale = _scale_tensor(scaler, device)
            scaled.backward()
            if step in inject:
                parallel.inject_inf(net, rank, world)
            if cfg.clip_grad_norm:
                parallel.clip(scaler, optimizer, net, cfg.clip_grad_norm)
            scaler.step(optimizer)
            try:
                scaler.update()
            except ScaleCollapseError as e:  # the update is done: the skip flag is readable
                rec.add(step, loss, scale, _skipped(scaler, scale, device))
                raise _at_training_step(e, e.step + offset) from None
            rec.add(step, loss, scale, _skipped(scaler, scale, device))
            optimizer.zero_grad(set_to_none=True)
            if len(rec.pending) >= cfg.log_every or step == cfg.steps:
                rows = rec.flush()
                if bar is not None:
                    bar.update(len(rows))
                    bar.set_postfix(
                        loss=f"{rows[-1]['loss']:.4f}",
                        scale=f"{rows[-1]['scale']:g}",
                        skipped=sum(r["skipped"] for r in rec.rows),
                        refresh=False,
                    )
            if cfg.ckpt_every and step % cfg.ckpt_every == 0 and step != cfg.steps:
                s0 = time.perf_counter()
                checkpoint.save(
                    checkpoint.path_for(cfg.out, step),
                    net,
                    optimizer,
                    scaler,
                    step,  # type: ignore[arg-type]
                    meta,
                    scaler_kind,
                    run,
                )
                saves += time.perf_counter() - s0
        train_time = time.perf_counter() - t0 - saves
    except ScaleCollapseError:
        rec.flush()
        if rank == 0:
            _plot(cfg)
        if world > 1:  # every rank sees the collapse at the same step: leave together, so the
            dist.barrier()  # launcher does not SIGTERM rank 0 while it still writes the plot
        raise
    finally:
        if bar is not None:
            bar.close()
    final = checkpoint.path_for(cfg.out, cfg.steps)  # type: ignore[arg-type]
    checkpoint.save(final, net, optimizer, scaler, cfg.steps, meta, scaler_kind, run)
    final_scale = float(_scale_tensor(scaler, device))
    test_loss, accuracy = evaluate(net, dataset, cfg, rank, world, device)
    if rank != 0:
        return None
    counts = _skip_counts(cfg, scaler, start, final_scale)
    n = cfg.steps - start
    summary = {
        "task": dataset.task,
        "setup": _setup(cfg, world, device),
        "parallel": cfg.parallel,
        "precision": cfg.precision,
        "reduce_dtype": cfg.reduce_dtype,
        "scaler": cfg.scaler,
        "policy": cfg.policy,
        "world_size": world,
        "steps": cfg.steps,
        "start_step": start,
        "resumed_from": str(path) if path is not None else None,
        "scaler_state_restored": scaler_loaded,
        "scaler_state_note": scaler_note,
        "run_changes": changes,
        "superseded": None
        if rec.superseded is None
        else {"folder": str(rec.superseded[0]), "checkpoints": rec.superseded[1]},
        "test_loss": test_loss,
        "test_accuracy": accuracy,
        "perplexity": math.exp(min(test_loss, 700.0)) if dataset.task == "text" else None,
        **counts,
        "final_scale": final_scale,
        "train_time": train_time,
        "time_per_step": train_time / max(n, 1),
        "out": str(cfg.out),
        "checkpoint": str(final),
        "plot": str(_plot(cfg)),
    }
    if isinstance(scaler, ShardedGradScaler):
        summary["scaler_metrics"] = scaler.metrics()
    report.write_summary(cfg.out, summary)  # type: ignore[arg-type]
    return summary


def _scaler_steps(scaler: Any) -> int:
    """Updates shardscale's scaler has counted (restored ones included); 0 for torch's."""
    if isinstance(scaler, ShardedGradScaler):
        return int(scaler.metrics().get("steps", 0))
    return 0


def _at_training_step(err: ScaleCollapseError, step: int) -> ScaleCollapseError:
    """``err`` with the step named as in ``metrics.jsonl`` and ``--inject-inf-step`` (from 1),
    not as the scaler's 0-based update index."""
    message = str(err)
    scaler_says = f"collapsed at step {err.step} "
    if scaler_says in message:
        message = message.replace(scaler_says, f"collapsed at training step {step} ", 1)
    else:
        message = f"loss scale collapsed at training step {step}: {message}"
    return ScaleCollapseError(message, err.step, err.scale, err.report)


def _skip_counts(cfg: TrainConfig, scaler: Any, start: int, final_scale: float) -> dict[str, Any]:
    """Skipped steps, backoffs and growths, and the steps they cover.

    shardscale's scaler counts them itself, restored from the checkpoint along with the scale;
    for torch's scaler they come from ``metrics.jsonl`` (the whole run when it holds every step,
    else this run segment: a resume into a new ``--out`` has only the steps after the resume).
    """
    if isinstance(scaler, ShardedGradScaler):
        m = scaler.metrics()
        return {
            "skipped_steps": int(m["skipped_steps"]),
            "backoffs": int(m["backoffs"]),
            "growths": int(m["growths"]),
            "skip_counts_steps": [cfg.steps - int(m["steps"]) + 1, cfg.steps],
            "skip_counts_from": "scaler",
        }
    rows = report.read_metrics(Path(cfg.out) / report.METRICS)  # type: ignore[arg-type]
    if [r["step"] for r in rows] != list(range(1, cfg.steps + 1)):
        rows = [r for r in rows if r["step"] > start]
    scales = [r["scale"] for r in rows] + [final_scale]
    return {
        "skipped_steps": sum(bool(r["skipped"]) for r in rows),
        "backoffs": sum(b < a for a, b in zip(scales[:-1], scales[1:], strict=True)),
        "growths": sum(b > a for a, b in zip(scales[:-1], scales[1:], strict=True)),
        "skip_counts_steps": [rows[0]["step"] if rows else start + 1, cfg.steps],
        "skip_counts_from": "metrics.jsonl",
    }


def _skipped(scaler: Any, scale_used: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Whether this rank skipped the step, as a 0-d tensor (no host sync on accelerators)."""
    if isinstance(scaler, ShardedGradScaler):
        return scaler.last_step_skipped()
    if not scaler.is_enabled():
        return torch.zeros((), device=device)
    # torch's scalers back off exactly when they skip: compare the scale before/after update().
    return scaler._get_scale_async().reshape(()) < scale_used


@torch.no_grad()
def evaluate(
    net: nn.Module,
    dataset: data.Dataset,
    cfg: TrainConfig,
    rank: int,
    world: int,
    device: torch.device,
) -> tuple[float, float]:
    """Mean cross-entropy and accuracy over the held-out set (each rank a share). Collective."""
    net.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    with parallel.autocast(cfg, device):
        for x, y in data.eval_shard(dataset, cfg, rank, world):
            x, y = x.to(device), y.to(device)
            logits = net(x)
            keep = y != -100
            totals[0] += _loss(logits, y, "sum").double()
            totals[1] += ((logits.argmax(-1).reshape(y.shape) == y) & keep).sum()
            totals[2] += keep.sum()
    if world > 1:
        dist.all_reduce(totals)
    net.train()
    loss_sum, correct, count = totals.tolist()
    return loss_sum / max(count, 1), correct / max(count, 1)


def _setup(cfg: TrainConfig, world: int, device: torch.device) -> str:
    what = "char transformer on " + Path(cfg.text).name if cfg.text else "digits MLP"
    if cfg.parallel == "none":
        return (
            f"{what}, single process, {device.type}, {cfg.precision} compute, scaler={cfg.scaler}"
        )
    backend = dist.get_backend() if dist.is_initialized() else "-"
    return (
        f"{what}, {cfg.parallel} x{world} ({backend}, {device.type}), {cfg.precision} compute, "
        f"{cfg.reduce_dtype} reduce, scaler={cfg.scaler}"
    )


def _plot(cfg: TrainConfig) -> Path:
    rows = report.read_metrics(Path(cfg.out) / report.METRICS)  # type: ignore[arg-type]
    title = f"shardscale train: {cfg.parallel}, {cfg.precision}, scaler={cfg.scaler}"
    if cfg.policy != "torch":
        title += f", policy={cfg.policy}"
    return report.plot(rows, Path(cfg.out) / report.PLOT, title)  # type: ignore[arg-type]


def _progress(cfg: TrainConfig, rank: int, start: int) -> Any:
    if rank != 0 or not cfg.progress:
        return None
    from tqdm import tqdm

    return tqdm(
        total=cfg.steps, initial=start, desc="train", unit="step", dynamic_ncols=True, leave=False
    )
