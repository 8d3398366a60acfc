"""shardscale: shard-aware dynamic loss scaling for mixed-precision distributed PyTorch.

``from shardscale import ShardedGradScaler`` replaces ``torch.amp.GradScaler`` and
``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` with no other change.
"""

from ._config import ScalerConfig
from ._grads import SharedMemoryGradError
from ._iteration import NotScaledError
from ._numerics import GroupNumerics, Numerics
from ._policy import COUNTER_NAMES, ScaleState, next_state
from ._report import OverflowEntry, OverflowReport, ScaleCollapseError
from .scaler import OptState, ShardedGradScaler

__version__ = "0.2.0"

__all__ = [
    "ShardedGradScaler",
    "OptState",
    "ScalerConfig",
    "ScaleCollapseError",
    "SharedMemoryGradError",
    "NotScaledError",
    "OverflowReport",
    "OverflowEntry",
    "Numerics",
    "GroupNumerics",
    "ScaleState",
    "next_state",
    "COUNTER_NAMES",
    "__version__",
]
