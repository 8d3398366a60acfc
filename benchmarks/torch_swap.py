"""Run PyTorch's own grad-scaler tests against shardscale: import this module first.

With ``GS_IMPL=shardscale`` every public name under which torch's tests build a grad scaler
builds a ``shardscale.ShardedGradScaler`` instead (``GS_IMPL=torch``, the default, changes
nothing): ``torch.amp.GradScaler`` / ``torch.GradScaler`` become the class itself (same
positional order; ``isinstance`` checks see it), ``torch.{cuda,cpu}.amp.GradScaler`` become factories mapping their arguments by keyword, FSDP's
``ShardedGradScaler`` a subclass taking its argument order (``backoff_factor`` before
``growth_factor``). How it was used (PyTorch's tests and the frameworks'): RELIABILITY.md.
"""

from __future__ import annotations

import os

import torch
import torch.amp.grad_scaler
from typing_extensions import deprecated

IMPL = os.environ.get("GS_IMPL", "torch")
if IMPL not in ("torch", "shardscale"):
    raise SystemExit(f"GS_IMPL must be 'torch' or 'shardscale', got {IMPL!r}")

if IMPL == "shardscale":
    import torch.cpu.amp
    import torch.cuda.amp
    import torch.distributed as dist

    from shardscale import ShardedGradScaler

    torch.amp.GradScaler = torch.amp.grad_scaler.GradScaler = ShardedGradScaler
    torch.GradScaler = ShardedGradScaler

    def _amp_alias(device: str):
        """torch's deprecated ``torch.<device>.amp.GradScaler`` alias, warning as torch's does."""

        @deprecated(
            f"`torch.{device}.amp.GradScaler(args...)` is deprecated. "
            f"Please use `torch.amp.GradScaler('{device}', args...)` instead.",
            category=FutureWarning,
        )
        def make(*args, **kwargs):  # torch's order after the device, as shardscale's
            return ShardedGradScaler(device, *args, **kwargs)

        return make

    torch.cuda.amp.GradScaler = _amp_alias("cuda")
    torch.cpu.amp.GradScaler = _amp_alias("cpu")

    class FSDPShardedGradScaler(ShardedGradScaler):
        """FSDP's ``ShardedGradScaler`` signature (``backoff_factor`` before
        ``growth_factor``) on shardscale's class: ``isinstance`` checks of frameworks see it."""

        def __init__(
            self,
            device="cuda",
            init_scale=2.0**16,
            backoff_factor=0.5,
            growth_factor=2.0,
            growth_interval=2000,
            enabled=True,
            process_group=None,
        ):
            super().__init__(
                device,
                init_scale=init_scale,
                growth_factor=growth_factor,
                backoff_factor=backoff_factor,
                growth_interval=growth_interval,
                enabled=enabled,
                process_group=process_group,
            )

    if dist.is_available():
        import sys

        import torch.distributed.fsdp as fsdp
        import torch.distributed.fsdp.sharded_grad_scaler as sharded

        sharded.ShardedGradScaler = FSDPShardedGradScaler
        fsdp.ShardedGradScaler = FSDPShardedGradScaler
        # torch's FSDP test utilities import the name; imported later, they get the swapped
        # class. Not imported here: their import disables torch.backends' global flags (which
        # breaks Lightning's ddp_spawn children) and needs expecttest.
        common_fsdp = sys.modules.get("torch.testing._internal.common_fsdp")
        if common_fsdp is not None:
            common_fsdp.ShardedGradScaler = FSDPShardedGradScaler
