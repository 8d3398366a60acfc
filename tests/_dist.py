"""Run a function on 2 CPU ranks with gloo: the helper every multi-process test uses.

``run_ranks(fn, tmp_path)`` forks ``world_size`` processes (torch.multiprocessing, start method
``fork``: ~0.1 s per launch), rendezvouses them on a file in ``tmp_path`` (no fixed port) and calls
``fn(rank, world_size, *args)`` in each after ``init_process_group("gloo")`` with a short timeout,
so a disagreement between ranks fails in seconds instead of hanging. A worker's exception is
re-raised in pytest with its traceback. ``fn`` returns a picklable value; the list of values (one
per rank) is returned.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = timedelta(seconds=30)


def _worker(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    store: str,
    out_dir: str,
    args: tuple,
    timeout: timedelta = TIMEOUT,
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size, timeout=timeout
    )
    try:
        result = fn(rank, world_size, *args)
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    tmp_path: Path | None = None,
    *args: Any,
    world_size: int = 2,
    timeout: timedelta | float | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's result.

    ``timeout`` (a ``timedelta`` or seconds) is the default process group's collective timeout,
    30 s if None.
    """
    if timeout is None:
        timeout = TIMEOUT
    elif not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    base = Path(tmp_path) if tmp_path is not None else Path(tempfile.mkdtemp())
    out_dir = tempfile.mkdtemp(dir=base)
    store = os.path.join(out_dir, "store")
    mp.start_processes(
        _worker,
        args=(fn, world_size, store, out_dir, args, timeout),
        nprocs=world_size,
        join=True,
        start_method="fork",
    )
    results = []
    for r in range(world_size):
        with open(os.path.join(out_dir, f"rank{r}.pkl"), "rb") as f:
            results.append(pickle.load(f))
    return results
