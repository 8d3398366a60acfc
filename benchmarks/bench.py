"""``shardscale bench``: unscale/check, scaler-cycle and clipping benchmark against torch.

One process. Every timed section runs its contenders *interleaved* (round r runs each contender
once, in an order rotated every round), together with the ``limit`` below. ``ms`` is the median
over rounds; ``x limit`` and ``x torch`` are medians of *paired* ratios (a contender's time over
the limit's / torch's time in the same round), so machine noise hits both sides of a ratio
alike. The rows:

* ``limit``: ``torch._foreach_mul_`` over the gradients (one read + one write of every byte), the
  physical limit of an in-place unscale; printed as GB/s.
* ``unscale``: ``unscale_`` (unscale + inf/NaN check + agreement) of shardscale,
  ``torch.amp.GradScaler``, torch's ``ShardedGradScaler`` (1-rank gloo group) and, at small sizes,
  a per-row ``.item()`` loop that mimics the original ShardedGradScaler's CPU path.
* ``cycle``: ``scale -> step -> update`` (step unscales) around SGD, AdamW, AdamW(fused=True).
* ``clip``: ``scaler.clip_grad_norm_`` vs torch's recipe ``unscale_`` +
  ``torch.nn.utils.clip_grad_norm_``; with SGD (clip only) and fused AdamW (clip only, and
  clip + step + update).
* ``counts`` (counted, not timed): host reads of tensor values per iteration (``item``,
  ``__bool__``, ``tolist``, ... via a ``TorchFunctionMode``) and collectives per iteration
  (``CommDebugMode``, with a 2-rank *fake* process group so that a collective is issued).
* ``memory``: the largest single allocation made while unscaling/clipping (torch profiler memory
  records on CPU, ``torch.cuda.max_memory_allocated`` on CUDA), against the gradient bytes.

Gradients are shaped like GPT-2-small's (transformer blocks first, then position and token
embeddings), truncated to the requested total number of elements, holding gradients scaled by
``SCALE`` (2**8, every contender's loss scale); the scaled values are copied back (untimed)
before each timed call, since each contender unscales them in place. ``max_norm`` lies above
the norm, so clipping multiplies by 1/scale only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from . import _cpukernel

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

#: Tensor shapes of one GPT-2-small transformer block (d_model 768, 4x MLP), Conv1D layout.
_BLOCK = [
    (768,),
    (768,),  # ln_1
    (768, 2304),
    (2304,),  # attn.c_attn
    (768, 768),
    (768,),  # attn.c_proj
    (768,),
    (768,),  # ln_2
    (768, 3072),
    (3072,),  # mlp.c_fc
    (3072, 768),
    (768,),  # mlp.c_proj
]

#: Functions whose host reads run only when the scaler state lives on the CPU (on an
#: accelerator these paths are asynchronous), so they are not counted as syncs.
_CPU_ONLY_READS = frozenset(
    {
        "_handle_collapse",
        "check_agreement",
        "step_in_place",
        "_cpu_norms",
        "global_norm_host",
        "_unscale_and_clip",  # its only reads are on the CPU branch
        "_unscale_and_clip_host",
        "_amp_update_scale_cpu_",
    }
)

#: Above this many elements the per-row reference loop is not timed (it is far too slow).
_REFERENCE_MAX = 2_000_000


def gpt2_small_shapes() -> list[tuple[int, ...]]:
    """GPT-2-small's parameter shapes (124M elements): 12 blocks, ln_f, wpe, wte."""
    return _BLOCK * 12 + [(768,), (768,), (1024, 768), (50257, 768)]


def gradient_shapes(total: int) -> list[tuple[int, ...]]:
    """GPT-2-small shapes taken in order until ``total`` elements (the last one truncated).

    Beyond GPT-2-small's 124M elements the list repeats. Raises ValueError for ``total < 1``.
    """
    if total < 1:
        raise ValueError(f"a gradient set needs at least 1 element, got {total}.")
    shapes: list[tuple[int, ...]] = []
    left = total
    while left > 0:
        for shape in gpt2_small_shapes():
            n = math.prod(shape)
            if n <= left:
                shapes.append(shape)
                left -= n
            else:
                cols = shape[-1] if len(shape) > 1 else 1
                rows = left // cols
                if rows:
                    shapes.append((rows, cols) if len(shape) > 1 else (rows,))
                    left -= rows * cols
                if left:
                    shapes.append((left,))
                    left = 0
            if left == 0:
                break
    return shapes


@dataclasses.dataclass
class Row:
    """One line of the benchmark table (times in ms; None where not applicable)."""

    section: str
    name: str
    numel: int
    dtype: str
    ms: float | None = None
    gbps: float | None = None
    x_limit: float | None = None
    x_torch: float | None = None
    value: str = ""  # counted sections: the counts; skipped rows: why

    def cells(self) -> list[str]:
        def f(v: float | None, fmt: str) -> str:
            return "" if v is None else format(v, fmt)

        return [
            self.section,
            self.name,
            _human(self.numel),
            self.dtype,
            f(self.ms, ".3f"),
            f(self.gbps, ".1f"),
            f(self.x_limit, ".2f"),
            f(self.x_torch, ".2f"),
            self.value,
        ]


HEADER = ["section", "contender", "elements", "dtype", "ms", "GB/s", "x limit", "x torch", "notes"]


def _human(n: int) -> str:
    if n >= 1_000_000:
        return f"{n / 1e6:g}M"
    if n >= 1000:
        return f"{n / 1e3:g}k"
    return str(n)


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1_000, "M": 1_000_000, "G": 1_000_000_000}.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in "KMG" else text
    try:
        value = int(float(number) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 10M, 500k, 1000") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be >= 1 element, got {text!r}")
    return value


def format_table(rows: Sequence[Row]) -> str:
    """The rows as an aligned plain-text (Markdown-compatible) table."""
    cells = [HEADER] + [r.cells() for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    lines = [
        "| " + " | ".join(c[i].ljust(widths[i]) for i in range(len(HEADER))) + " |" for c in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


# ------------------------------------------------------------------------------- timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass
class Contender:
    """A timed callable: ``before()`` (untimed) then ``run()`` (timed), once per round."""

    name: str
    run: Callable[[], Any]
    before: Callable[[], Any] = lambda: None
    is_torch: bool = False
    times: list[float] = dataclasses.field(default_factory=list)
    error: str = ""
    note: str = ""


def time_interleaved(
    contenders: list[Contender],
    rounds: int,
    device: torch.device,
    warmup: int = 1,
    reset: Callable[[], Any] = lambda: None,
) -> None:
    """Fill each contender's ``times`` (seconds): ``warmup`` + ``rounds`` interleaved rounds.

    ``reset()`` (untimed) runs before each contender's ``before()``: e.g. restoring the scaled
    gradients that the previous contender unscaled in place."""
    live = list(contenders)
    for r in range(warmup + rounds):
        shift = r % max(1, len(live))
        for c in live[shift:] + live[:shift]:
            if c.error:
                continue
            try:
                reset()
                c.before()
                _sync(device)
                t0 = time.perf_counter()
                c.run()
                _sync(device)
                elapsed = time.perf_counter() - t0
            except Exception as e:  # a contender that cannot run this case (e.g. fp16 grads)
                c.error = f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:60]}"
                continue
            if r >= warmup:
                c.times.append(elapsed)


# ----------------------------------------------------------------------- gradient sets
class GradSet:
    """Parameters with preset gradients shaped like GPT-2-small, on one device and dtype."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.params: list[torch.nn.Parameter] = []
        for shape in gradient_shapes(numel):
            p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
            grad = torch.randn(shape, generator=gen) * (1e-3 * SCALE)
            p.grad = grad.to(dtype=dtype, device=device)
            self.params.append(p)
        self.scaled = [p.grad.clone() for p in self.params]  # restore() copies these back
        self.numel = numel
        self.dtype = dtype
        self.device = device
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
        if kind == "adamw":
            return torch.optim.AdamW(self.params, lr=1e-6, foreach=True)
        if kind == "adamw_fused":
            return torch.optim.AdamW(self.params, lr=1e-6, fused=True)
        raise ValueError(kind)


# ------------------------------------------------------------------------------ scalers
_BIG = 2**30  # growth interval: the scale stays SCALE
#: The loss scale of every contender. Not 1.0: an unscale by 1 may skip its writes (shardscale's
#: CPU kernel does), which no training step at a real scale gets to do.
SCALE = 2.0**8


def _shardscale(device: torch.device, **kw: Any) -> Any:
    from .scaler import ShardedGradScaler

    return ShardedGradScaler(device.type, init_scale=SCALE, growth_interval=_BIG, **kw)


def _torch_amp(device: torch.device) -> Any:
    return torch.amp.GradScaler(device.type, init_scale=SCALE, growth_interval=_BIG)


def _torch_sharded(device: torch.device, process_group: Any = None) -> Any:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

    kw = {} if process_group is None else {"process_group": process_group}
    return TorchSharded(device=device.type, init_scale=SCALE, growth_interval=_BIG, **kw)


def _reference_unscale_rows(grads: list[torch.Tensor], found_inf: torch.Tensor, inv: torch.Tensor):
    """mimics the reference's per-row .item() loop (the original ShardedGradScaler's CPU path):
    for every row of every gradient, two ``.item()`` reads (isinf/isnan) and one for the scale.
    Written here for timing only; it is not shardscale's algorithm."""
    for grad in grads:
        for row in grad if grad.dim() > 0 else grad.view(1):
            if torch.isinf(row).any().item() or torch.isnan(row).any().item():
                found_inf.fill_(1.0)
                break
            row.mul_(inv.item())


class _Cycle:
    """One scaler driving one optimizer with a constant loss (gradients are preset)."""

    def __init__(self, scaler: Any, optimizer: torch.optim.Optimizer, device: torch.device):
        self.scaler, self.opt = scaler, optimizer
        self.loss = torch.ones((), device=device)
        self.pending = False
        self.scaler.scale(self.loss)  # creates the scale tensor

    def close(self) -> None:
        """Close an iteration left open (after unscale_/clip) with update(), untimed."""
        if self.pending:
            self.scaler.update()
            self.pending = False

    def unscale(self) -> None:
        self.scaler.unscale_(self.opt)
        self.pending = True

    def clip_shardscale(self) -> None:
        self.scaler.clip_grad_norm_(self.opt, 1e30)
        self.pending = True

    def clip_torch(self) -> None:
        self.scaler.unscale_(self.opt)
        params = [p for g in self.opt.param_groups for p in g["params"]]
        torch.nn.utils.clip_grad_norm_(params, 1e30)
        self.pending = True

    def step(self) -> None:
        self.scaler.scale(self.loss)
        self.scaler.step(self.opt)
        self.scaler.update()

    def clip_step(self, torch_recipe: bool) -> None:
        self.scaler.scale(self.loss)
        (self.clip_torch if torch_recipe else self.clip_shardscale)()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.pending = False


# ------------------------------------------------------------------------------ sections
@dataclasses.dataclass
class Config:
    """What to run (see ``shardscale bench --help``)."""

    sizes: list[int]
    dtypes: list[str]
    rounds: int = 5
    device: str = "cpu"
    sections: tuple[str, ...] = ("unscale", "cycle", "clip", "counts", "memory")
    reference: bool = True
    torch_sharded: bool = True
    threads: int | None = None  # torch.set_num_threads for the run; None: leave torch's default


def paired_ratio(c: Contender, ref: Contender) -> float | None:
    """Median over rounds of ``c``'s time / ``ref``'s time *in the same round* (None if either
    has no times): noise that hits one round hits both contenders of the ratio alike."""
    pairs = [a / b for a, b in zip(c.times, ref.times, strict=False) if b > 0]
    return statistics.median(pairs) if pairs else None


def _rows_from(
    section: str,
    gs: GradSet,
    dtype: str,
    contenders: list[Contender],
    limit: Contender | None,
    traffic: float | None,
) -> list[Row]:
    """Rows for ``contenders`` (timed in the same interleaved rounds as ``limit``): ms and GB/s
    from each one's median time, ``x limit`` / ``x torch`` as :func:`paired_ratio`."""
    base = next((c for c in contenders if c.is_torch and c.times and not c.error), None)
    rows = []
    for c in contenders:
        if c.error or not c.times:
            rows.append(Row(section, c.name, gs.numel, dtype, value=c.error or "skipped"))
            continue
        t = statistics.median(c.times)
        rows.append(
            Row(
                section,
                c.name,
                gs.numel,
                dtype,
                ms=t * 1e3,
                gbps=None if traffic is None else traffic / t / 1e9,
                x_limit=None if limit is None else paired_ratio(c, limit),
                x_torch=None if base is None else paired_ratio(c, base),
                value=c.note,
            )
        )
    return rows


def _bench_case(cfg: Config, gs: GradSet, dtype: str, pg: Any) -> list[Row]:
    device = gs.device
    rows: list[Row] = []
    inv = torch.full((), 1.0 / SCALE, device=device)

    def limit() -> Contender:
        """The physical limit, timed in the same interleaved rounds as each section's
        contenders (every ``x limit`` is a ratio of times from the same rounds)."""
        return Contender(
            "in-place multiply (read+write)", lambda: torch._foreach_mul_(gs.grads, inv)
        )

    if "unscale" not in cfg.sections:  # the limit row still heads the block
        lim = limit()
        time_interleaved([lim], cfg.rounds, device, reset=gs.restore)
        rows += _rows_from("limit", gs, dtype, [lim], lim, 2 * gs.nbytes)

    if "unscale" in cfg.sections:
        opt = gs.optimizer("sgd")
        cyc = {
            "shardscale": _Cycle(_shardscale(device), opt, device),
            "torch GradScaler": _Cycle(_torch_amp(device), opt, device),
        }
        if cfg.torch_sharded and pg is not None:
            cyc["torch ShardedGradScaler"] = _Cycle(_torch_sharded(device, pg), opt, device)
        cont = [
            Contender(n, c.unscale, c.close, is_torch=n == "torch GradScaler")
            for n, c in cyc.items()
        ]
        if device.type == "cpu":
            kernel = _cpukernel.status()
            cont[0].note = "compiled CPU kernel" if kernel.available else "torch's kernel"
            if kernel.available and DTYPES[dtype] in kernel.dtypes:
                # the same scaler with torch's CPU kernel: what the compiled kernel buys
                alt = cyc["shardscale, torch's kernel"] = _Cycle(_shardscale(device), opt, device)

                def unscale_torch_kernel(alt: _Cycle = alt) -> None:
                    with _cpukernel.torch_kernel():
                        alt.unscale()

                cont.insert(
                    1, Contender("shardscale, torch's kernel", unscale_torch_kernel, alt.close)
                )
            elif not kernel.available:
                error_line = kernel.reason.strip().splitlines()[-1][:70]
                cont[0].note += f" ({error_line})"
        if cfg.reference and device.type == "cpu" and gs.numel <= _REFERENCE_MAX:
            flag = torch.zeros((), device=device)
            cont.append(
                Contender(
                    "per-row .item() loop (original)",
                    lambda: _reference_unscale_rows(gs.grads, flag, inv),
                )
            )
        lim = limit()
        time_interleaved([lim, *cont], cfg.rounds, device, reset=gs.restore)
        for c in cyc.values():
            c.close()
        rows += _rows_from("limit", gs, dtype, [lim], lim, 2 * gs.nbytes)
        rows += _rows_from("unscale", gs, dtype, cont, lim, 2 * gs.nbytes)

    if "cycle" in cfg.sections:
        for kind in ("sgd", "adamw", "adamw_fused"):
            makers = {"shardscale": _shardscale, "torch GradScaler": _torch_amp}
            if cfg.torch_sharded and pg is not None:
                makers["torch ShardedGradScaler"] = lambda d: _torch_sharded(d, pg)
            cont = []
            for name, make in makers.items():
                c = _Cycle(make(device), gs.optimizer(kind), device)
                cont.append(
                    Contender(f"{name} [{kind}]", c.step, is_torch=name == "torch GradScaler")
                )
            lim = limit()
            time_interleaved([lim, *cont], cfg.rounds, device, reset=gs.restore)
            rows += _rows_from("cycle", gs, dtype, cont, lim, None)
            del cont
            for p in gs.params:  # reset the parameters AdamW moved
                p.data.zero_()

    if "clip" in cfg.sections:
        # torch.amp.GradScaler refuses fp16 gradients: torch's recipe then uses its ShardedGradScaler
        torch_maker = _torch_amp
        torch_name = "torch unscale_+clip_grad_norm_"
        if gs.dtype == torch.float16 and pg is not None:
            torch_maker = lambda d: _torch_sharded(d, pg)  # noqa: E731
            torch_name += " (torch ShardedGradScaler)"
        for kind in ("sgd", "adamw_fused"):
            ours = _Cycle(_shardscale(device), gs.optimizer(kind), device)
            theirs = _Cycle(torch_maker(device), gs.optimizer(kind), device)
            cont = [
                Contender(f"shardscale clip_grad_norm_ [{kind}]", ours.clip_shardscale, ours.close),
                Contender(f"{torch_name} [{kind}]", theirs.clip_torch, theirs.close, is_torch=True),
            ]
            if kind == "adamw_fused":
                cont += [
                    Contender(
                        f"shardscale clip+step+update [{kind}]",
                        lambda o=ours: o.clip_step(False),
                        ours.close,
                    ),
                    Contender(
                        f"torch clip+step+update [{kind}]",
                        lambda t=theirs: t.clip_step(True),
                        theirs.close,
                    ),
                ]
            lim = limit()
            time_interleaved([lim, *cont], cfg.rounds, device, reset=gs.restore)
            ours.close()
            theirs.close()
            new = _rows_from("clip", gs, dtype, cont[:2], lim, None)
            if len(cont) > 2:
                cont[3].is_torch = True  # the torch recipe's clip+step+update is this pair's base
                new += _rows_from("clip", gs, dtype, cont[2:], lim, None)
            rows += new
            for p in gs.params:
                p.data.zero_()
    return rows


# ------------------------------------------------------------------------------- counts
class _ReadCounter(torch.overrides.TorchFunctionMode):
    """Counts host reads of tensor values; CPU-only scaler paths and torch.optim internals
    (which read CPU step counters by design) are counted apart."""

    READS = {"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy"}

    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0
        self.cpu_only = 0
        self.optimizer = 0

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
            where = "syncs"
            while frame is not None:
                if frame.f_code.co_name in _CPU_ONLY_READS:
                    where = "cpu_only"
                    break
                if os.sep + os.path.join("torch", "optim") + os.sep in frame.f_code.co_filename:
                    where = "optimizer"
                    break
                frame = frame.f_back
            setattr(self, where, getattr(self, where) + 1)
        return func(*args, **(kwargs or {}))


def count_per_iteration(device: torch.device, pg: Any) -> list[Row]:
    """Host syncs and collectives of one iteration, per scaler, optimizer and path.

    ``pg`` must be a process group of size > 1 (a fake one is fine) so that collectives are
    issued; it is passed to both sharded scalers.
    """
    from torch.distributed.tensor.debug import CommDebugMode

    rows = []
    gs = GradSet(20_000, torch.float32, device)
    scalers = {
        "shardscale": lambda: _shardscale(device, process_group=pg),
        "torch GradScaler": lambda: _torch_amp(device),
        "torch ShardedGradScaler": lambda: _torch_sharded(device, pg),
    }
    for kind in ("sgd", "adamw_fused"):
        for path in ("step", "clip"):
            for name, make in scalers.items():
                cyc = _Cycle(make(), gs.optimizer(kind), device)
                fn = (
                    cyc.step
                    if path == "step"
                    else (lambda c=cyc, n=name: c.clip_step(n != "shardscale"))
                )
                label = f"{name} [{kind}, {'scale+step+update' if path == 'step' else 'clip path'}]"
                try:
                    fn()  # warm-up (lazy state)
                    with CommDebugMode() as comm, _ReadCounter() as reads:
                        fn()
                except Exception as e:  # e.g. torch's own unscale_ + fused step on CPU
                    value = f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:70]}"
                else:
                    value = (
                        f"syncs={reads.syncs} collectives={comm.get_total_counts()} "
                        f"(cpu-only reads={reads.cpu_only}, optimizer reads={reads.optimizer})"
                    )
                rows.append(Row("counts", label, gs.numel, "fp32", value=value))
    return rows


# ------------------------------------------------------------------------------- memory
@contextlib.contextmanager
def _without_profiler_chatter() -> Iterator[None]:
    """Hold back the ``USDT:... profiler_start``/``profiler_stop`` lines that torch's profiler
    (kineto) writes to the process's stderr (file descriptor 2) at every start and stop; any
    other line written there meanwhile is passed on when the block ends."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2: nothing to hold back
        yield
        return
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
            rest = "".join(line for line in lines if not line.startswith("USDT:"))
            if rest:
                sys.stderr.write(rest)
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


def _clip_chunk_bytes() -> int:
    """Bytes of the fp32 scratch buffer clip_grad_norm_ converts fp16 CPU gradients through."""
    from ._norm import _CPU_CHUNK

    return _CPU_CHUNK * 4


def memory_rows(numel: int, device: torch.device, pg: Any) -> list[Row]:
    """Largest allocation during unscale_/clip vs the largest gradient, fp16 and fp32."""
    rows = []
    for dname in ("fp32", "fp16"):
        gs = GradSet(numel, DTYPES[dname], device)
        largest = max(g.numel() * g.element_size() for g in gs.grads)
        opt = gs.optimizer("sgd")
        cases: dict[str, Callable[[], _Cycle]] = {
            "shardscale unscale_": lambda opt=opt: _Cycle(_shardscale(device), opt, device),
            "shardscale clip_grad_norm_": lambda opt=opt: _Cycle(_shardscale(device), opt, device),
        }
        if dname == "fp32":
            cases["torch GradScaler unscale_"] = lambda opt=opt: _Cycle(
                _torch_amp(device), opt, device
            )
            cases["torch unscale_+clip_grad_norm_"] = lambda opt=opt: _Cycle(
                _torch_amp(device), opt, device
            )
        for name, make in cases.items():
            cyc = make()
            fn = cyc.clip_shardscale if "clip" in name else cyc.unscale
            if name.startswith("torch unscale_+clip"):
                fn = cyc.clip_torch
            fn()
            cyc.close()
            peak = _largest_allocation(fn, device)
            cyc.close()
            rows.append(
                Row(
                    "memory",
                    name,
                    numel,
                    dname,
                    value=(
                        f"largest allocation {peak} B = {peak / largest:.4f} x the largest "
                        f"gradient ({largest} B)"
                    ),
                )
            )
    return rows


# ----------------------------------------------------------------------- process groups
@contextlib.contextmanager
def _process_group(backend: str, world_size: int) -> Iterator[Any]:
    """A default process group for the duration (gloo 1 rank, or 'fake' with N ranks).

    Yields None if torch.distributed is unavailable or a group already exists (then the
    existing default group is used when it is suitable).
    """
    import torch.distributed as dist

    if not dist.is_available():
        yield None
        return
    if dist.is_initialized():
        yield dist.group.WORLD if dist.get_world_size() == world_size else None
        return
    if backend == "fake":
        try:
            from torch.testing._internal.distributed.fake_pg import FakeStore
        except ImportError:
            yield None
            return
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            dist.init_process_group(
                backend, init_method=f"file://{tmp}/store", rank=0, world_size=world_size
            )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------- run
def run(cfg: Config, log: Callable[[str], None] = print) -> list[Row]:
    """Run the benchmark described by ``cfg`` and return its rows (``log`` gets progress)."""
    device = torch.device(cfg.device)
    rows: list[Row] = []
    if "counts" in cfg.sections:
        with _process_group("fake", 2) as pg:
            if pg is None:
                log("counts skipped: no fake process group available")
            else:
                rows += count_per_iteration(device, pg)
    timed = {"unscale", "cycle", "clip"} & set(cfg.sections)
    if not timed and "memory" not in cfg.sections:
        return rows
    backend = "nccl" if device.type == "cuda" else "gloo"
    with _process_group(backend, 1) as pg:
        for numel in cfg.sizes if timed else []:
            for dname in cfg.dtypes:
                log(f"... {_human(numel)} {dname}")
                gs = GradSet(numel, DTYPES[dname], device)
                rows += _bench_case(cfg, gs, dname, pg)
                del gs
        if "memory" in cfg.sections:
            rows += memory_rows(min(cfg.sizes), device, pg)
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardscale bench",
        description="Time shardscale's unscale/check, scaler cycle and clipping against torch's "
        "GradScaler / ShardedGradScaler, side by side (median of interleaved rounds).",
    )
    p.add_argument(
        "--sizes",
        default="10M,50M,100M",
        help="comma-separated gradient-set sizes in elements (e.g. 10M,50M). Default 10M,50M,100M.",
    )
    p.add_argument(
        "--dtypes", default="fp32,fp16,bf16", help="comma-separated from fp32,fp16,bf16."
    )
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per contender (median).")
    p.add_argument("--device", default="cpu", help="cpu or cuda. Default cpu.")
    p.add_argument(
        "--sections",
        default="unscale,cycle,clip,counts,memory",
        help="comma-separated subset of unscale,cycle,clip,counts,memory.",
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny sizes (200k), fp32+fp16, 2 rounds: a smoke test."
    )
    p.add_argument("--no-reference", action="store_true", help="skip the per-row .item() loop.")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for the run (torch.set_num_threads). Default: torch's default.",
    )
    return p


def parse_config(argv: Sequence[str]) -> Config:
    """Parse ``shardscale bench`` arguments into a :class:`Config` (argparse exits on error)."""
    p = _parser()
    a = p.parse_args(list(argv))
    if a.quick:
        sizes, dtypes, rounds = [200_000], ["fp32", "fp16"], 2
        if "--sizes" in argv:
            sizes = [_parse_size(s) for s in a.sizes.split(",")]
    else:
        try:
            sizes = [_parse_size(s) for s in a.sizes.split(",") if s.strip()]
        except argparse.ArgumentTypeError as e:
            p.error(str(e))
        dtypes, rounds = [d.strip() for d in a.dtypes.split(",") if d.strip()], a.rounds
    if "--dtypes" in argv:
        dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    if "--rounds" in argv:
        rounds = a.rounds
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        p.error(f"--dtypes: unknown {bad}; choose from {sorted(DTYPES)}")
    if rounds < 1:
        p.error("--rounds must be >= 1")
    sections = tuple(s.strip() for s in a.sections.split(",") if s.strip())
    unknown = set(sections) - {"unscale", "cycle", "clip", "counts", "memory"}
    if unknown or not sections:
        p.error(f"--sections: unknown {sorted(unknown)}")
    if a.threads is not None and a.threads < 1:
        p.error("--threads must be >= 1")
    try:
        kind = torch.device(a.device).type
    except (RuntimeError, ValueError):
        kind = ""
    if kind not in ("cpu", "cuda"):
        p.error(f"--device: {a.device!r} is not supported; use cpu or cuda")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available on this machine")
    return Config(
        sizes=sizes,
        dtypes=dtypes,
        rounds=rounds,
        device=a.device,
        sections=sections,
        reference=not a.no_reference,
        threads=a.threads,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``shardscale bench [--sizes 10M,50M,100M] [--dtypes fp32,fp16,bf16] [--rounds 5]
    [--quick] [--device cpu|cuda] [--sections ...] [--threads N]``: print the benchmark table.

    Returns:
        0 on success (argparse exits with 2 on bad arguments).
    """
    cfg = parse_config(sys.argv[1:] if argv is None else argv)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    log(
        f"shardscale bench: torch {torch.__version__}, device {cfg.device}, "
        f"{torch.get_num_threads()} threads, sizes {[_human(s) for s in cfg.sizes]}, "
        f"dtypes {cfg.dtypes}, {cfg.rounds} rounds"
    )
    rows = run(cfg, log)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
