"""One training process: ``python -m shardscale.train.worker [options]``.

Started by ``shardscale train`` through torch's elastic launcher, or directly by ``torchrun``::

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m shardscale.train.worker --parallel fsdp2 --precision fp16 --out runs/two-nodes

It reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` from the environment
(without them it runs as a single process), initializes the default process group (gloo on CPU,
NCCL on CUDA), runs :func:`shardscale.train.loop.train` and prints the summary on rank 0.

Errors end the process with one line and an exit code: 2 for a bad option or input file and
for a collapsed loss scale (``ScaleCollapseError``), 1 for anything else. Under ``shardscale
train`` (``SHARDSCALE_TRAIN_LAUNCHER=1``) the line goes to torch elastic's error file and the
launcher prints it once; otherwise the worker prints it itself (rank 0 for errors every rank
sees, the failing rank otherwise). ``SHARDSCALE_DEBUG=1`` adds the traceback.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from shardscale import ScaleCollapseError

from .config import ConfigError, parse, validate

PREFIX = "shardscale train: error: "
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def one_line(text: str) -> str:
    """``text`` without ANSI escape codes (torch colours some messages), on one line."""
    return " ".join(_ANSI.sub("", text).split())


def main(argv: list[str] | None = None) -> int:
    """Run one rank. Returns the process exit code (0, 1 or 2; see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    env = os.environ
    rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    local_rank = int(env.get("LOCAL_RANK", 0))
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    try:
        cfg = validate(parse(argv), world_size=world)
        if cfg.device == "cuda":
            if local_rank >= torch.cuda.device_count():
                raise ConfigError(
                    f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible); "
                    "lower --nproc-per-node."
                )
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
        else:
            device = torch.device("cpu")
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local_world, 1)))
        _init_process_group(device, rank, world)
        if cfg.scaler == "torch":  # torch.amp.GradScaler on FSDP2 DTensor grads warns each step
            warnings.filterwarnings("ignore", message="Found a non-scalar tensor")
        from .loop import train
        from .report import table

        summary = train(cfg, rank, world, device)
        if summary is not None:
            print(table(summary), flush=True)
        if world > 1:  # leave together: no rank tears gloo down while rank 0 still reports
            dist.barrier()
        return 0
    except (ConfigError, ScaleCollapseError) as e:
        return _fail(str(e), 2, rank, every_rank=True)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        text = _ANSI.sub("", str(e)).strip().splitlines()
        return _fail(f"rank {rank}: {type(e).__name__}: {text[0] if text else ''}", 1, rank, False)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _init_process_group(device: torch.device, rank: int, world: int) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, timeout=timedelta(minutes=5), **kwargs)
    else:  # plain `python -m shardscale.train.worker`: a group of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)


def _fail(message: str, code: int, rank: int, every_rank: bool) -> int:
    """Report ``message`` once (see the module docstring) and return ``code``."""
    line = one_line(message)  # one line, whatever the exception text held
    if os.environ.get("SHARDSCALE_DEBUG"):
        traceback.print_exc()
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with open(error_file, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    if not os.environ.get("SHARDSCALE_TRAIN_LAUNCHER") and (rank == 0 or not every_rank):
        print(PREFIX + line, file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
