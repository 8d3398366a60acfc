"""shardscale: shard-aware dynamic loss scaling for mixed-precision distributed PyTorch.

``from shardscale import ShardedGradScaler`` replaces ``torch.amp.GradScaler`` and
``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` with no other change.
"""

from ._config import ScalerConfig
from ._policy import PyScaleState, ScaleState, next_state, reference_step
from ._report import OverflowEntry, OverflowReport, ScaleCollapseError
from .scaler import OptState, ShardedGradScaler

__version__ = "0.1.0"

__all__ = [
    "ShardedGradScaler",
    "OptState",
    "ScalerConfig",
    "ScaleCollapseError",
    "OverflowReport",
    "OverflowEntry",
    "ScaleState",
    "PyScaleState",
    "next_state",
    "reference_step",
    "__version__",
]
