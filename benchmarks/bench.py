"""shardscale against torch, side by side in one process (public names of shardscale only).

    python benchmarks/bench.py                     # 10M,50M,100M x fp32,fp16,bf16, all sections
    python benchmarks/bench.py --quick             # smoke test: 200k elements, 2 rounds
    python benchmarks/bench.py --sizes 10M --dtypes fp16 --rounds 20 --sections unscale,clip
    python benchmarks/bench.py --rounds 7 --json rows.json

Sections: ``unscale`` (``unscale_``; torch's kernel alone), ``cycle`` (scale, step, update around
SGD / AdamW / fused AdamW), ``clip`` (``clip_grad_norm_(optimizer, max_norm)`` vs torch's recipe
``unscale_`` + ``torch.nn.utils.clip_grad_norm_``), ``counts`` (per steady-state iteration: host
reads seen by a ``TorchFunctionMode``, those inside ``torch.optim`` apart, collectives seen by
``CommDebugMode`` and aten ops outside ``torch.optim`` seen by a ``TorchDispatchMode``, each path
beside torch's: scale+step+update, and scale+clip+step+update against torch's recipe; in this
process and on 2 forked gloo ranks), ``memory`` (the largest allocation during the call vs the
largest gradient). Timed contenders run *interleaved* (round r runs each once, the order rotated
every round) with the ``limit``, ``torch._foreach_mul_`` over the same gradients (one read + one
write of each byte). ``ms``: median over rounds; ``x limit`` /
``x torch``: medians of same-round ratios, against ``torch.amp.GradScaler`` (torch's recipe for
``clip``) or, where it refuses fp16 gradients, torch's FSDP ``ShardedGradScaler`` on a 1-rank
gloo group. Timing targets bind from 10M elements. Gradients: GPT-2-small shapes truncated to
the size, scaled by ``SCALE`` (not 1.0: an unscale by 1 may skip its writes), copied back
(untimed) before each timed call; ``max_norm`` lies above the norm (clipping multiplies by 1/S).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardscale import ShardedGradScaler

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SECTIONS = ("unscale", "cycle", "clip", "counts", "memory")
SCALE = 2.0**8
_BIG = 2**30  # growth interval: the scale stays SCALE
TARGET_MIN_NUMEL = 10_000_000
#: Largest allocation allowed to shardscale's unscale_/clip (bytes): fp16 norms' fp32 pieces.
SCRATCH = (1 << 20) + 1024
#: Steady-state iterations per counts row (shardscale polls its alarm every 16 updates).
COUNT_ITERS = 16

#: One GPT-2-small block (d_model 768, 4x MLP, Conv1D layout): ln_1 (weight, bias), attn.c_attn,
#: attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj (weight, bias each).
_BLOCK = [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,), (768,), (768,)]
_BLOCK += [(768, 3072), (3072,), (3072, 768), (768,)]


def gpt2_small_shapes() -> list[tuple[int, ...]]:
    """GPT-2-small's parameter shapes (124M elements): 12 blocks, ln_f, wpe, wte."""
    return _BLOCK * 12 + [(768,), (768,), (1024, 768), (50257, 768)]


def gradient_shapes(total: int) -> list[tuple[int, ...]]:
    """GPT-2-small shapes taken in order until ``total`` elements, the last one truncated (whole
    rows of a matrix, then the rest flat); beyond 124M elements the list repeats.

    Raises ValueError for ``total < 1``.
    """
    if total < 1:
        raise ValueError(f"a gradient set needs at least 1 element, got {total}.")
    shapes: list[tuple[int, ...]] = []
    left = total
    for shape in itertools.cycle(gpt2_small_shapes()):
        if math.prod(shape) <= left:
            shapes.append(shape)
            left -= math.prod(shape)
        else:
            rows = left // shape[-1] if len(shape) > 1 else 0
            rest = left - rows * shape[-1]
            shapes += ([(rows, shape[-1])] if rows else []) + ([(rest,)] if rest else [])
            left = 0
        if left == 0:
            return shapes
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------- rows
@dataclasses.dataclass
class Row:
    """One line of the table (times in ms; None where not applicable). ``target``: what
    shardscale's row must reach; ``met``: whether it did (None: not binding / not measured)."""

    section: str
    name: str
    numel: int
    dtype: str
    ms: float | None = None
    gbps: float | None = None
    x_limit: float | None = None
    x_torch: float | None = None
    target: str = ""
    met: bool | None = None
    notes: str = ""
    counts: dict[str, float] | None = None  # counts and memory rows, for --json

    def cells(self) -> list[str]:
        nums = [(self.ms, ".3f"), (self.gbps, ".1f"), (self.x_limit, ".2f"), (self.x_torch, ".2f")]
        verdict = {True: "met", False: "MISSED", None: "not binding"}[self.met]
        return [
            *(self.section, self.name, _human(self.numel), self.dtype),
            *("" if v is None else format(v, fmt) for v, fmt in nums),
            f"{self.target}: {verdict}" if self.target else "",
            self.notes,
        ]


HEADER = ["section", "contender", "elements", "dtype", "ms", "GB/s", "x limit", "x torch"]
HEADER += ["target", "notes"]


def _human(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k" if n >= 1000 else str(n)


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1_000, "M": 1_000_000, "G": 1_000_000_000}.get(text[-1:], 1)
    try:
        value = int(float(text[:-1] if text[-1:] in "KMG" else text) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 10M, 500k, 1000") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be >= 1 element, got {text!r}")
    return value


def format_table(rows: Sequence[Row]) -> str:
    """The rows as an aligned plain-text (Markdown-compatible) table."""
    cells = [HEADER] + [r.cells() for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    lines = ["| " + " | ".join(c[i].ljust(w) for i, w in enumerate(widths)) + " |" for c in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def summary(rows: Sequence[Row]) -> str:
    """How many binding targets were met, and the rows that missed."""
    judged = [r for r in rows if r.met is not None]
    missed = [f"{r.section} {r.name} {_human(r.numel)} {r.dtype}" for r in judged if not r.met]
    text = f"targets: {len(judged) - len(missed)} of {len(judged)} binding rows met"
    return text + "".join(f"\n  MISSED: {m}" for m in missed)


# -------------------------------------------------------------------------------- timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass
class Contender:
    """A timed callable: ``before()`` (untimed) then ``run()`` (timed), once per round."""

    name: str
    run: Callable[[], Any]
    before: Callable[[], Any] = lambda: None
    is_torch: bool = False  # a baseline for ``x torch`` (the first one that ran is used)
    target: float | None = None  # the largest allowed ``x torch``
    times: list[float] = dataclasses.field(default_factory=list)
    error: str = ""


def _error(e: Exception) -> str:
    return f"n/a: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:70]}"


def time_interleaved(
    contenders: list[Contender], rounds: int, device: torch.device, reset: Callable | None = None
) -> None:
    """Fill each contender's ``times`` (seconds): 1 warm-up + ``rounds`` interleaved rounds;
    ``reset()`` (untimed, e.g. restoring the scaled gradients) runs before each ``before()``."""
    for r in range(1 + rounds):
        shift = r % len(contenders)
        for c in contenders[shift:] + contenders[:shift]:
            if c.error:
                continue
            try:
                if reset is not None:
                    reset()
                c.before()
                _sync(device)
                t0 = time.perf_counter()
                c.run()
                _sync(device)
                elapsed = time.perf_counter() - t0
            except Exception as e:  # a contender that cannot run this case (e.g. fp16 grads)
                c.error = _error(e)
                continue
            if r >= 1:
                c.times.append(elapsed)


def paired_ratio(c: Contender, ref: Contender) -> float | None:
    """Median over rounds of ``c``'s time / ``ref``'s time *in the same round* (None if either
    has no times): noise that hits one round hits both contenders of the ratio alike."""
    pairs = [a / b for a, b in zip(c.times, ref.times, strict=False) if b > 0]
    return statistics.median(pairs) if pairs else None


def _rows_from(
    section: str, gs: GradSet, contenders: list[Contender], limit: Contender, traffic: bool
) -> list[Row]:
    """Rows for ``contenders`` (timed in the same rounds as ``limit``)."""
    base = next((c for c in contenders if c.is_torch and c.times), None)
    rows = []
    for c in contenders:
        row = Row(section, c.name, gs.numel, gs.dtype_name, notes=c.error)
        row.target = "" if c.target is None else f"x torch <= {c.target:g}"
        rows.append(row)
        if not c.times:
            continue
        t = statistics.median(c.times)
        row.ms, row.gbps = t * 1e3, 2 * gs.nbytes / t / 1e9 if traffic else None
        row.x_limit = paired_ratio(c, limit)
        row.x_torch = None if base is None else paired_ratio(c, base)
        if base is not None and "ShardedGradScaler" in base.name and c is not base:
            row.notes = "x torch: vs torch's ShardedGradScaler"
        if c.target is not None and row.x_torch is not None and gs.numel >= TARGET_MIN_NUMEL:
            row.met = row.x_torch <= c.target
    return rows


# ------------------------------------------------------------------------ gradient sets
class GradSet:
    """Parameters with preset scaled gradients shaped like GPT-2-small, one device and dtype."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.params: list[torch.nn.Parameter] = []
        for shape in gradient_shapes(numel):
            p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
            grad = torch.randn(shape, generator=gen) * (1e-3 * SCALE)
            p.grad = grad.to(dtype=dtype, device=device)
            self.params.append(p)
        self.scaled = [p.grad.clone() for p in self.params]  # restore() copies these back
        self.numel, self.dtype, self.device = numel, dtype, device
        self.dtype_name = next(k for k, v in DTYPES.items() if v == dtype)
        self.nbytes = sum(p.grad.numel() * p.grad.element_size() for p in self.params)

    @property
    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params]

    def restore(self) -> None:
        """Put the scaled gradients back (contenders unscale them in place)."""
        torch._foreach_copy_(self.grads, self.scaled)

    def optimizer(self, kind: str) -> torch.optim.Optimizer:
        if kind == "sgd":
            return torch.optim.SGD(self.params, lr=1e-6)
        if kind in ("adamw_foreach", "adamw_fused"):  # the flag after "adamw_" is set
            return torch.optim.AdamW(self.params, lr=1e-6, **{kind[6:]: True})
        raise ValueError(f"unknown optimizer kind {kind!r}")


# ------------------------------------------------------------------------------ scalers
def _scalers(pg: Any) -> dict[str, Callable[[torch.device], Any]]:
    """The contenders' scalers by name (torch's ShardedGradScaler only with a process group)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

    kw = {"init_scale": SCALE, "growth_interval": _BIG}
    makers = {
        "shardscale": lambda d: ShardedGradScaler(d.type, **kw),
        "torch GradScaler": lambda d: torch.amp.GradScaler(d.type, **kw),
    }
    if pg is not None:
        makers["torch ShardedGradScaler"] = lambda d: TorchSharded(d.type, process_group=pg, **kw)
    return makers


class _Cycle:
    """One scaler driving one optimizer with a constant loss (gradients are preset)."""

    def __init__(self, scaler: Any, optimizer: torch.optim.Optimizer, device: torch.device):
        self.scaler, self.opt = scaler, optimizer
        self.ours = isinstance(scaler, ShardedGradScaler)
        self.loss = torch.ones((), device=device)
        self.pending = False
        self.scaler.scale(self.loss)  # creates the scale tensor

    def close(self) -> None:
        """Close an iteration left open (after unscale_/clip) with update() and begin the next
        one with scale(), untimed."""
        if self.pending:
            self.scaler.update()
            self.scaler.scale(self.loss)
            self.pending = False

    def unscale(self) -> None:
        self.scaler.unscale_(self.opt)
        self.pending = True

    def clip(self) -> None:
        """shardscale's clip_grad_norm_, or torch's recipe for torch's scalers."""
        if self.ours:
            self.scaler.clip_grad_norm_(self.opt, 1e30)
        else:
            self.scaler.unscale_(self.opt)
            params = [p for g in self.opt.param_groups for p in g["params"]]
            torch.nn.utils.clip_grad_norm_(params, 1e30)
        self.pending = True

    def step(self, clip: bool = False) -> None:
        self.scaler.scale(self.loss)
        if clip:
            self.clip()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.pending = False


# ----------------------------------------------------------------------- timed sections
@dataclasses.dataclass
class Config:
    """What to run (see ``python benchmarks/bench.py --help``)."""

    sizes: list[int]
    dtypes: list[str]
    rounds: int = 5
    device: str = "cpu"
    sections: tuple[str, ...] = SECTIONS
    ranks: int = 2  # counts: 2 also forks a pair of gloo ranks (CPU only)
    threads: int | None = None  # torch.set_num_threads for the run; None: torch's default


def _bench_case(cfg: Config, gs: GradSet, pg: Any) -> list[Row]:
    device, rows, makers = gs.device, [], _scalers(pg)
    inv, mul = torch.full((), 1.0 / SCALE, device=device), torch._foreach_mul_

    def timed(section: str, cont: list[Contender], traffic: bool = False) -> list[Row]:
        lim = Contender("in-place multiply (read+write)", functools.partial(mul, gs.grads, inv))
        time_interleaved([lim, *cont], cfg.rounds, device, reset=gs.restore)
        head = _rows_from("limit", gs, [lim], lim, True) if section == "unscale" else []
        return head + _rows_from(section, gs, cont, lim, traffic)

    def scaler_rows(kind: str, method: str) -> list[Contender]:
        """One contender per scaler: ``method`` of a _Cycle; shardscale's has the target."""
        opt = gs.optimizer(kind)
        cont = []
        for name, make in makers.items():
            c = _Cycle(make(device), opt if method == "unscale" else gs.optimizer(kind), device)
            label = name if method == "unscale" else f"{name} [{kind}]"
            ours = name == "shardscale"
            cont.append(
                Contender(label, getattr(c, method), c.close, not ours, 1.05 if ours else None)
            )
        return cont

    if "unscale" in cfg.sections:
        flag = torch.zeros((), device=device)
        kernel = functools.partial(torch._amp_foreach_non_finite_check_and_unscale_, gs.grads)
        kernel = functools.partial(kernel, flag, inv)
        cont = [*scaler_rows("sgd", "unscale"), Contender("torch kernel alone (no scaler)", kernel)]
        rows += timed("unscale", cont, traffic=True)
    if "cycle" in cfg.sections:
        for kind in ("sgd", "adamw_foreach", "adamw_fused"):
            rows += timed("cycle", scaler_rows(kind, "step"))
            for p in gs.params:  # reset the parameters AdamW moved
                p.data.zero_()
    if "clip" in cfg.sections:
        # torch.amp.GradScaler refuses fp16 gradients: the recipe then uses its ShardedGradScaler
        name = "torch GradScaler"
        if gs.dtype == torch.float16 and pg is not None:
            name = "torch ShardedGradScaler"
        recipe = f"torch unscale_+clip_grad_norm_ ({name})"
        for kind, target in (("sgd", 0.75), ("adamw_fused", 0.55)):
            ours = _Cycle(makers["shardscale"](device), gs.optimizer(kind), device)
            theirs = _Cycle(makers[name](device), gs.optimizer(kind), device)
            mine = Contender(f"shardscale clip_grad_norm_ [{kind}]", ours.clip, ours.close)
            mine.target = target
            rows += timed(
                "clip", [mine, Contender(f"{recipe} [{kind}]", theirs.clip, theirs.close, True)]
            )
            if kind == "adamw_fused":  # informative (the fused step dominates): no target
                both = [("shardscale", ours), ("torch", theirs)]
                cont = [
                    Contender(
                        f"{n} clip+step+update [{kind}]",
                        functools.partial(c.step, True),
                        c.close,
                        c is theirs,
                    )
                    for n, c in both
                ]
                rows += timed("clip", cont)
                for p in gs.params:
                    p.data.zero_()
    return rows


# ------------------------------------------------------------------------------- counts
class _ReadCounter(torch.overrides.TorchFunctionMode):
    """Counts host reads of tensor values; reads inside ``torch.optim`` (CPU step counters, by
    design) are counted apart."""

    READS = {"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy"}
    _OPTIM = os.sep + os.path.join("torch", "optim") + os.sep

    def __init__(self) -> None:
        super().__init__()
        self.reads = self.optimizer = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = getattr(func, "__name__", "")
        is_read = name in self.READS or (
            name in ("cpu", "to")
            and args
            and isinstance(args[0], torch.Tensor)
            and args[0].device.type != "cpu"
            and (name == "cpu" or "cpu" in str(args[1:]) + str(kwargs))
        )
        if is_read:
            frame = sys._getframe(1)
            while frame is not None and self._OPTIM not in frame.f_code.co_filename:
                frame = frame.f_back
            if frame is None:
                self.reads += 1
            else:
                self.optimizer += 1
        return func(*args, **(kwargs or {}))


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched (on an accelerator each is a kernel launch), except those
    of ``torch.optim`` (the optimizer's own math)."""

    _OPTIM = os.sep + os.path.join("torch", "optim") + os.sep

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        frame = sys._getframe(1)
        while frame is not None and self._OPTIM not in frame.f_code.co_filename:
            frame = frame.f_back
        self.ops += frame is None
        return func(*args, **(kwargs or {}))


#: aten ops per steady-state iteration (one process, default arguments), by (optimizer, with
#: clip_grad_norm_): scale, [clip,] step, update (torch's GradScaler: 10 / 9, with its
#: unscale_ + clip_grad_norm_ recipe 18 / 18)
OPS_TARGET = {
    ("sgd", False): 15,
    ("adamw_fused", False): 14,
    ("sgd", True): 32,
    ("adamw_fused", True): 30,
}


def count_rows(device: torch.device, pg: Any, where: str, expect_collectives: int) -> list[Row]:
    """Host reads and collectives per steady-state iteration (median over ``COUNT_ITERS``
    iterations after 2 warm-up ones; totals in the notes), per scaler, optimizer and path."""
    from torch.distributed.tensor.debug import CommDebugMode

    rows, gs = [], GradSet(20_000, torch.float32, device)
    for kind in ("sgd", "adamw_fused"):
        for clip in (False, True):
            for name, make in _scalers(pg).items():
                cyc = _Cycle(make(device), gs.optimizer(kind), device)
                path = "scale+clip+step+update" if clip else "scale+step+update"
                row = Row("counts", f"{name} [{kind}, {path}, {where}]", gs.numel, "fp32")
                expect = (0 if kind == "adamw_fused" else 1, expect_collectives)
                max_ops = OPS_TARGET[kind, clip] if where == "1 process" else None
                if name == "shardscale":
                    row.target = "reads={} collectives={}".format(*expect)
                    row.target += f" aten<={max_ops}" if max_ops else ""
                reads, colls, ops, optim = [], [], [], 0
                rows.append(row)
                try:
                    for i in range(2 + COUNT_ITERS):
                        gs.restore()
                        with CommDebugMode() as comm, _ReadCounter() as counter:
                            with _OpCounter() as opc:
                                cyc.step(clip)
                        if i >= 2:
                            reads.append(counter.reads)
                            colls.append(comm.get_total_counts())
                            ops.append(opc.ops)
                            optim += counter.optimizer
                except Exception as e:  # e.g. torch's ShardedGradScaler + fused step on CPU
                    row.notes = _error(e)
                    continue
                per_iter = (statistics.median(reads), statistics.median(colls))
                row.counts = dict(zip(("host_reads", "collectives"), per_iter, strict=True))
                row.counts.update(host_reads_total=sum(reads), collectives_total=sum(colls))
                row.counts.update(optimizer_reads_total=optim, iterations=COUNT_ITERS)
                row.counts.update(aten_ops=statistics.median(ops))
                row.notes = "host reads={:g} collectives={:g} aten ops={:g} per iteration".format(
                    *per_iter, statistics.median(ops)
                )
                row.notes += f" ({sum(reads)} / {sum(colls)} in {COUNT_ITERS}; "
                row.notes += f"torch.optim reads {optim})"
                ops_met = max_ops is None or statistics.median(ops) <= max_ops
                row.met = per_iter == expect and ops_met if row.target else None
    return rows


def _pair_worker(rank: int, store: str, out: str) -> None:
    """One of two forked gloo ranks: count; rank 0 writes its rows as JSON to ``out``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    url, timeout = f"file://{store}", timedelta(seconds=60)
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=2, timeout=timeout)
    try:
        rows = count_rows(torch.device("cpu"), dist.group.WORLD, "2 gloo ranks", 1)
        if rank == 0:
            with open(out, "w") as f:
                json.dump([dataclasses.asdict(r) for r in rows], f)
    finally:
        dist.destroy_process_group()


def pair_count_rows() -> list[Row]:
    """:func:`count_rows` on two forked CPU processes joined by gloo (rank 0's rows)."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or dist.is_initialized():
        return [Row("counts", "2 gloo ranks", 0, "", notes="n/a: a process group exists")]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        try:
            args = (os.path.join(tmp, "store"), out)
            mp.start_processes(_pair_worker, args=args, nprocs=2, start_method="fork")
            with open(out) as f:
                return [Row(**r) for r in json.load(f)]
        except Exception as e:
            return [Row("counts", "2 gloo ranks", 0, "", notes=_error(e))]


# ------------------------------------------------------------------------------- memory
@contextlib.contextmanager
def _without_profiler_chatter() -> Iterator[None]:
    """Hold back the ``USDT:... profiler_start``/``profiler_stop`` lines that torch's profiler
    (kineto) writes to file descriptor 2 at every start and stop; any other line written there
    meanwhile is passed on when the block ends."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(ln for ln in lines if not ln.startswith("USDT:")))
            sys.stderr.flush()


def _largest_allocation(fn: Callable[[], Any], device: torch.device) -> int:
    """Bytes of the largest memory allocated by ``fn`` above what existed before."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - base)
    from torch.profiler import ProfilerActivity, profile

    with (
        open(os.devnull, "w") as devnull,
        contextlib.redirect_stdout(devnull),
        _without_profiler_chatter(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        fn()
    # each op event's cpu_memory_usage: bytes it (and its children) allocated and kept/freed
    return max([0] + [int(e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage > 0])


def memory_rows(numel: int, dtypes: Sequence[str], device: torch.device, pg: Any) -> list[Row]:
    """Largest allocation during unscale_ / clipping vs the largest gradient, per dtype; target
    for shardscale: at most ``SCRATCH`` bytes (a bounded scratch, never a gradient-sized one: fp16
    norms are taken in fp32 piece by piece, each piece's conversion at most 1 MiB)."""
    rows, makers = [], _scalers(pg)
    for dname in dtypes:
        gs = GradSet(numel, DTYPES[dname], device)
        largest = max(g.numel() * g.element_size() for g in gs.grads)
        torch_name = "torch GradScaler"
        if dname == "fp16" and pg is not None:
            torch_name = "torch ShardedGradScaler"
        for label, name, what in (
            ("shardscale unscale_", "shardscale", "unscale"),
            ("shardscale clip_grad_norm_", "shardscale", "clip"),
            (f"{torch_name} unscale_", torch_name, "unscale"),
            (f"torch unscale_+clip_grad_norm_ ({torch_name})", torch_name, "clip"),
        ):
            row = Row("memory", label, numel, dname)
            row.target = "<= 1 MiB + 1 KiB" if name == "shardscale" else ""
            rows.append(row)
            cyc = _Cycle(makers[name](device), gs.optimizer("sgd"), device)
            fn = getattr(cyc, what)
            try:
                fn()  # warm-up (lazy state)
                cyc.close()
                peak = _largest_allocation(fn, device)
                cyc.close()
            except Exception as e:  # torch's GradScaler refuses fp16 gradients
                row.notes = _error(e)
                continue
            row.counts = {"largest_allocation": peak, "largest_gradient": largest}
            row.notes = f"largest allocation {peak} B = {peak / largest:.4f} x the largest "
            row.notes += f"gradient ({largest} B)"
            row.met = peak <= SCRATCH if row.target else None
    return rows


# ------------------------------------------------------------------------------- driver
@contextlib.contextmanager
def _one_rank_group(backend: str) -> Iterator[Any]:
    """A 1-rank default process group for the duration (torch's ShardedGradScaler needs one;
    shardscale leaves 1-rank groups out: no collective). None if none can be made; an existing
    default group if it has one rank."""
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        yield dist.group.WORLD if dist.is_available() and dist.get_world_size() == 1 else None
        return
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def run(cfg: Config, log: Callable[[str], None] = print) -> list[Row]:
    """Run the benchmark described by ``cfg`` and return its rows (``log`` gets progress)."""
    device = torch.device(cfg.device)
    rows: list[Row] = []
    pair: list[Row] = []
    if "counts" in cfg.sections and cfg.ranks == 2 and device.type == "cpu":
        log("... counts on 2 gloo ranks")
        pair = pair_count_rows()  # first: forked before this process makes a process group
    with _one_rank_group("nccl" if device.type == "cuda" else "gloo") as pg:
        if "counts" in cfg.sections:
            rows += count_rows(device, pg, "1 process", 0) + pair
        if {"unscale", "cycle", "clip"} & set(cfg.sections):
            for numel in cfg.sizes:
                for dname in cfg.dtypes:
                    log(f"... {_human(numel)} {dname}")
                    rows += _bench_case(cfg, GradSet(numel, DTYPES[dname], device), pg)
        if "memory" in cfg.sections:
            rows += memory_rows(min(cfg.sizes), cfg.dtypes, device, pg)
    return rows


def parse_config(argv: Sequence[str]) -> tuple[Config, str | None]:
    """The :class:`Config` and the ``--json`` path (argparse exits with 2 on bad arguments)."""
    p = argparse.ArgumentParser(prog="benchmarks/bench.py", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", help="comma-separated sizes in elements. Default 10M,50M,100M.")
    p.add_argument("--dtypes", help="comma-separated from fp32,fp16,bf16. Default all three.")
    p.add_argument("--rounds", type=int, help="timed rounds per contender (median). Default 5.")
    p.add_argument("--device", default="cpu", help="cpu or cuda. Default cpu.")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset.")
    p.add_argument("--quick", action="store_true", help="defaults 200k elements, 2 rounds.")
    p.add_argument(
        "--ranks",
        type=int,
        choices=(1, 2),
        default=2,
        help="counts: 2 (default): "
        "in this process and on 2 forked gloo ranks (CPU); 1: this process only.",
    )
    p.add_argument("--threads", type=int, help="torch.set_num_threads for the run.")
    p.add_argument("--json", metavar="PATH", help="also write the rows to PATH as JSON.")
    a = p.parse_args(list(argv))
    try:
        sizes = [_parse_size(s) for s in (a.sizes or "").split(",") if s.strip()]
    except argparse.ArgumentTypeError as e:
        p.error(f"--sizes: {e}")
    sizes = sizes or ([200_000] if a.quick else [10_000_000, 50_000_000, 100_000_000])
    dtypes = [d.strip() for d in (a.dtypes or ",".join(DTYPES)).split(",") if d.strip()]
    rounds = a.rounds if a.rounds is not None else 2 if a.quick else 5
    sections = tuple(s.strip() for s in a.sections.split(",") if s.strip())
    kind = ""
    with contextlib.suppress(RuntimeError, ValueError):
        kind = torch.device(a.device).type
    if not dtypes or set(dtypes) - set(DTYPES):
        p.error(f"--dtypes: {a.dtypes!r}; choose from {','.join(DTYPES)}")
    if not sections or set(sections) - set(SECTIONS):
        p.error(f"--sections: {a.sections!r}; choose from {','.join(SECTIONS)}")
    if rounds < 1 or (a.threads is not None and a.threads < 1):
        p.error("--rounds and --threads must be >= 1")
    if kind not in ("cpu", "cuda"):
        p.error(f"--device: {a.device!r} is not supported; use cpu or cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available on this machine")
    return Config(sizes, dtypes, rounds, a.device, sections, a.ranks, a.threads), a.json


def _load() -> str:
    """The 1-minute load average: other work on the machine shows in the timings."""
    return f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "n/a"


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table and the targets' summary (and write ``--json``). Returns 0; argparse
    exits with 2 on bad arguments."""
    cfg, json_path = parse_config(sys.argv[1:] if argv is None else argv)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    log(
        f"benchmarks/bench.py: torch {torch.__version__}, device {cfg.device}, "
        f"{torch.get_num_threads()} threads, sizes {[_human(s) for s in cfg.sizes]}, dtypes "
        f"{cfg.dtypes}, {cfg.rounds} rounds, sections {','.join(cfg.sections)}, load {_load()}"
    )
    start = time.perf_counter()
    rows = run(cfg, log)
    print(format_table(rows))
    print(summary(rows))
    log(f"done in {time.perf_counter() - start:.0f} s, load {_load()}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
