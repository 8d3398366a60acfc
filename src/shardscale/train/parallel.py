"""Parallelism and precision: wrap the model (FSDP2, FSDP1, DDP or nothing), pick the scaler.

================  ==========================================  =================================
``--parallel``    parameters / compute                        gradient reduction
================  ==========================================  =================================
fsdp2             ``fully_shard`` + ``MixedPrecisionPolicy``  reduce-scatter in ``--reduce-dtype``
fsdp1             ``FullyShardedDataParallel`` +              reduce-scatter in ``--reduce-dtype``
                  ``MixedPrecision`` (``use_orig_params``)
ddp               fp32 master + ``torch.autocast``            all-reduce (fp16/bf16 compress hook
                                                              if ``--reduce-dtype`` is not fp32)
none              fp32 master + ``torch.autocast``            none (one process)
================  ==========================================  =================================

In every mode the optimizer (AdamW) updates fp32 master weights, as in torch's AMP recipe.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import nn

from shardscale import ShardedGradScaler

from .config import DTYPES, TrainConfig


def wrap(model: nn.Module, cfg: TrainConfig, device: torch.device) -> nn.Module:
    """Move ``model`` to ``device`` and apply ``cfg.parallel`` with ``cfg.precision``.

    Needs an initialized default process group except for ``"none"``.
    """
    model = model.to(device)
    low = cfg.precision != "fp32"
    param_dtype, reduce_dtype = DTYPES[cfg.precision], DTYPES[cfg.reduce_dtype]
    units = model.shard_units()  # type: ignore[operator]
    if cfg.parallel == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for unit in units:
            fully_shard(unit, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model
    if cfg.parallel == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

        unit_ids = {id(u) for u in units}
        policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in unit_ids)
        mp1 = (
            MixedPrecision(
                param_dtype=param_dtype, reduce_dtype=reduce_dtype, buffer_dtype=param_dtype
            )
            if low or cfg.reduce_dtype != "fp32"
            else None
        )
        return FullyShardedDataParallel(
            model,
            auto_wrap_policy=policy,
            mixed_precision=mp1,
            use_orig_params=True,
            device_id=device,  # required on CPU: without it FSDP1 looks for an accelerator
        )
    if cfg.parallel == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        if cfg.reduce_dtype == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif cfg.reduce_dtype == "bf16":
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        return ddp
    return model


def autocast(cfg: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` for DDP/none in fp16/bf16; FSDP casts parameters itself (no autocast)."""
    if cfg.precision == "fp32" or cfg.parallel in ("fsdp2", "fsdp1"):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[cfg.precision])


def make_scaler(cfg: TrainConfig, device: torch.device) -> Any:
    """The loss scaler of ``cfg``.

    ``--scaler shardscale``: :class:`~shardscale.ShardedGradScaler` in fp16 (``init_scale``,
    ``growth_interval``, ``max_consecutive_skips``, ``policy``); :meth:`ShardedGradScaler.guard` in bf16 and
    fp32 (scale fixed at 1.0, non-finite steps still skipped on every rank).
    ``--scaler torch``: torch's scaler for the set-up in fp16 (``torch.amp.GradScaler``; FSDP1:
    ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``), a disabled
    ``torch.amp.GradScaler`` in bf16/fp32 (torch's recipe: no scaling).
    """
    if cfg.scaler == "shardscale":
        if cfg.precision == "fp16":
            # policy="headroom" has no growth interval (the scaler would warn it is unused)
            torch_rule = (
                {} if cfg.policy == "headroom" else {"growth_interval": cfg.growth_interval}
            )
            return ShardedGradScaler(
                device.type,
                init_scale=cfg.init_scale,
                max_consecutive_skips=cfg.max_consecutive_skips,
                policy=cfg.policy,  # resolved: checkpoint.resolve_scaler_options
                **torch_rule,
            )
        return ShardedGradScaler.guard(max_consecutive_skips=cfg.max_consecutive_skips)
    if cfg.precision != "fp16":
        return torch.amp.GradScaler(device.type, enabled=False)
    if cfg.parallel == "fsdp1":
        from torch.distributed.fsdp.sharded_grad_scaler import (
            ShardedGradScaler as TorchShardedGradScaler,
        )

        return TorchShardedGradScaler(
            device.type, init_scale=cfg.init_scale, growth_interval=cfg.growth_interval
        )
    return torch.amp.GradScaler(
        device.type, init_scale=cfg.init_scale, growth_interval=cfg.growth_interval
    )


def local_grads(model: nn.Module) -> list[torch.Tensor]:
    """This rank's gradient tensors (the local shard of DTensor gradients), non-empty only."""
    out = []
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        g = g.to_local() if hasattr(g, "to_local") else g
        if g.numel():
            out.append(g)
    return out


def inject_inf(model: nn.Module, rank: int, world: int) -> None:
    """Debug overflow: the last rank writes +inf into the first element of its first local
    gradient shard (after the reduction, so only that rank sees it unless the scaler agrees)."""
    if rank == world - 1:
        grads = local_grads(model)
        if grads:
            grads[0].view(-1)[0] = float("inf")


def clip(scaler: Any, optimizer: torch.optim.Optimizer, model: nn.Module, max_norm: float) -> None:
    """Clip the global gradient norm to ``max_norm`` on unscaled gradients.

    ``ShardedGradScaler.clip_grad_norm_`` with shardscale's scaler (unscale + global norm over
    shards and ranks); otherwise torch's recipe ``scaler.unscale_(opt)`` followed by
    ``FSDP.clip_grad_norm_`` (FSDP1) or ``torch.nn.utils.clip_grad_norm_`` (DTensor-aware).
    """
    if isinstance(scaler, ShardedGradScaler):
        scaler.clip_grad_norm_(optimizer, max_norm)
        return
    scaler.unscale_(optimizer)
    if hasattr(model, "clip_grad_norm_"):  # FSDP1 computes the norm over all shards
        model.clip_grad_norm_(max_norm)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
