"""Loss-scale policies in real fp16 training: torch's rule against ``policy="headroom"``.

    python benchmarks/policies.py                        # digits + text, 300 / 100 steps (~10 min on 2 cores)
    python benchmarks/policies.py --quick                # smoke test: digits, 12 steps (seconds)
    python benchmarks/policies.py --tasks digits --steps 300 --plot docs/img/policies.png
    python benchmarks/policies.py --cost                 # the paired time per step (~2 min)
    python benchmarks/policies.py --cost --device cuda   # the same on a GPU (benchmarks/gpu_check.py)
    python benchmarks/policies.py --cold                 # small ops right after a backward pass

The demo's models (``shardscale train``: the digits MLP, and the character transformer of
``--text``, here on CPython's ``LICENSE.txt``), one process, CPU fp16 autocast, AdamW fused and
not, from initial scales 2**0, 2**16 and 2**24, with ``torch.amp.GradScaler``
(``growth_interval`` 2000 and 50) and ``shardscale.ShardedGradScaler(policy="headroom")``: the
same seed, initial weights and batches for every scaler. Per run: skipped steps in steps 1-20
and after, the mean log2 scale, the fraction of weight-gradient elements (parameters of 2+
dimensions) that are 0 in the fp16 backward but not in an fp32 backward of the same batch
(sampled at :data:`SAMPLE_STEPS`, mean), test loss and accuracy, the step to reach 2**10, and the
time per step (sampled steps left out) as a ratio to torch's ``growth_interval=2000`` run of the
same row. Public API only (``shardscale`` and its ``shardscale.train`` demo).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import sysconfig
import time
from typing import Any

import torch
import torch.nn.functional as F

from shardscale import ShardedGradScaler
from shardscale.train import data as sdata
from shardscale.train import model as smodel
from shardscale.train.config import TrainConfig
from shardscale.train.loop import lr_at

#: Steps at which the fp32 backward of the same batch is compared (underflow).
SAMPLE_STEPS = (1, 20, 100, 200, 300)
SCALERS = ("torch gi2000", "torch gi50", "headroom")
TEXT = os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt")


def _cfg(task: str, steps: int, seed: int) -> TrainConfig:
    cfg = TrainConfig(
        parallel="none", steps=steps, seed=seed, text=TEXT if task == "text" else None
    )
    cfg.hidden, cfg.nproc = (128 if task == "text" else 256), 1
    if task == "text":
        cfg.batch_size = 32
    return cfg


def _loss(logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1),
        ignore_index=-100, reduction=reduction,
    )  # fmt: skip


def _scaler(kind: str, init: float) -> Any:
    if kind == "headroom":
        return ShardedGradScaler("cpu", init_scale=init, policy="headroom")
    return torch.amp.GradScaler("cpu", init_scale=init, growth_interval=int(kind.split("gi")[1]))


@torch.no_grad()
def _evaluate(net: torch.nn.Module, ds: Any, cfg: TrainConfig) -> tuple[float, float]:
    net.eval()
    tot = torch.zeros(3, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.float16):
        for x, y in sdata.eval_shard(ds, cfg, 0, 1):
            logits = net(x)
            keep = y != -100
            tot[0] += _loss(logits, y, "sum").double()
            tot[1] += ((logits.argmax(-1).reshape(y.shape) == y) & keep).sum()
            tot[2] += keep.sum()
    net.train()
    return (tot[0] / tot[2]).item(), (tot[1] / tot[2]).item()


def _underflow(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float | None:
    """Weight-gradient elements zero in the fp16 backward (``p.grad``, scaled) but not in an
    fp32 backward of the same batch; None if the fp16 gradients are not finite."""
    weights = [p for p in net.parameters() if p.dim() >= 2]
    g16 = [p.grad for p in weights]
    if not all(bool(torch.isfinite(g).all()) for g in g16):
        return None
    g32 = torch.autograd.grad(_loss(net(x), y), weights)
    nonzero = sum(int((a != 0).sum()) for a in g32)
    lost = sum(int(((a != 0) & (b == 0)).sum()) for a, b in zip(g32, g16, strict=True))
    return lost / max(nonzero, 1)


def run(task: str, fused: bool, kind: str, init_e: int, steps: int, seed: int, ds: Any) -> dict:
    """One training run; returns its row (and ``es``: the log2 scale used at each step)."""
    cfg = _cfg(task, steps, seed)
    torch.manual_seed(seed)
    net = smodel.build(cfg, ds)
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)
    batches = sdata.Batches(ds, cfg, 0, 1)
    scaler = _scaler(kind, 2.0**init_e)
    es, skipped, under, timed = [], [], [], 0.0
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        x, y = batches.get(step)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(net(x), y)
        before = scaler.get_scale()
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if step in SAMPLE_STEPS:
            u = _underflow(net, x, y)
            if u is not None:
                under.append(u)
        scaler.step(opt)
        scaler.update()
        after = scaler.get_scale()  # the host read both scalers' users make to log the scale
        if step not in SAMPLE_STEPS:
            timed += time.perf_counter() - t0
        es.append(math.log2(before))
        if isinstance(scaler, ShardedGradScaler):
            skipped.append(bool(scaler.last_step_skipped()))
        else:
            skipped.append(after < before)  # torch backs off exactly when it skips
    test_loss, acc = _evaluate(net, ds, cfg)
    skips = [i + 1 for i, s in enumerate(skipped) if s]
    timed_steps = steps - sum(1 for s in SAMPLE_STEPS if s <= steps)
    return {
        "task": task, "opt": "fused" if fused else "adamw", "scaler": kind, "init_e": init_e,
        "skips_1_20": sum(1 for s in skips if s <= 20), "skips_after": sum(1 for s in skips if s > 20),
        "reach10": next((i + 1 for i, e in enumerate(es) if e >= 10), None),
        "mean_e": sum(es) / len(es), "underflow": sum(under) / len(under) if under else None,
        "test_loss": test_loss, "test_acc": acc, "step_s": timed / max(timed_steps, 1), "es": es,
    }  # fmt: skip


def _stepper(
    task: str, fused: bool, kind: str, seed: int, ds: Any, measure_every: int = 1,
    device: str = "cpu",
):  # fmt: skip
    """One contender of :func:`cost`: a function running ``n`` training steps (the demo's
    model from ``seed`` on ``device``, fixed LR, batches cycling from step 1)
    with a ``ShardedGradScaler`` of ``policy=kind`` from 2**16 (no overflow in these models),
    or torch's ``GradScaler`` (``kind="torch.amp"``)."""
    cfg = _cfg(task, 10**6, seed)
    torch.manual_seed(seed)
    net = smodel.build(cfg, ds).to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, fused=fused)
    batches = sdata.Batches(ds, cfg, 0, 1)
    if kind == "torch.amp":
        scaler: Any = torch.amp.GradScaler(device, init_scale=2.0**16)
    else:
        scaler = ShardedGradScaler(
            device, init_scale=2.0**16, policy=kind, measure_every=measure_every
        )
    state = {"step": 0}

    def steps(n: int) -> float:
        """``n`` steps (the device synchronised at the end); returns the host's seconds in
        ``scaler.step`` and ``scaler.update`` (off the CPU: launching their work)."""
        inside = 0.0
        for _ in range(n):
            state["step"] += 1
            x, y = (t.to(device) for t in batches.get(state["step"]))
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=torch.float16):
                loss = _loss(net(x), y)
            scaler.scale(loss).backward()
            t0 = time.perf_counter()
            scaler.step(opt)
            scaler.update()
            inside += time.perf_counter() - t0
        if device != "cpu":
            getattr(torch, torch.device(device).type).synchronize()
        return inside

    return steps


def cost(
    task: str, fused: bool, seed: int, ds: Any, rounds: int, per_round: int, device: str = "cpu"
) -> dict:
    """The cost of ``policy="headroom"`` (and ``measure_every=4``) against ``policy="torch"`` of
    the same scaler, and of shardscale against ``torch.amp.GradScaler``: interleaved rounds
    (each runs every contender ``per_round`` steps, the order rotated), medians of same-round
    values, so that the machine's drift hits both sides alike. Per contender: the time per
    step, and the time inside ``scaler.step`` + ``scaler.update`` (the optimizer's step
    included, the same on both sides). The headline is the added time inside those calls as a
    fraction of a whole step (``policy="torch"``'s): the models train at different scales,
    and the forward and backward passes' times move with the values (fp16 subnormals on the
    CPU), so whole-step ratios mix that in."""
    kinds = ("torch", "headroom", "headroom/4", "torch.amp")
    run_ = {
        k: _stepper(
            task, fused, k.split("/")[0], seed, ds, int(k.split("/")[1]) if "/" in k else 1, device
        )
        for k in kinds
    }
    for k in kinds:
        run_[k](3)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in kinds}
    inside: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(rounds):
        order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
        for k in order:
            t0 = time.perf_counter()
            inside[k].append(run_[k](per_round) / per_round)
            times[k].append((time.perf_counter() - t0) / per_round)

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    def added(a: str, b: str) -> float:  # a's extra time in the scaler's calls / b's step
        return median([(x - y) / t for x, y, t in zip(inside[a], inside[b], times[b], strict=True)])

    def ratio(a: str, b: str) -> float:
        return median([x / y for x, y in zip(times[a], times[b], strict=True)])

    return {
        "task": task, "opt": "fused" if fused else "adamw", "device": device,
        "step_ms": 1e3 * median(times["torch"]),
        "calls_ms": {k: 1e3 * median(v) for k, v in inside.items()},
        "headroom": added("headroom", "torch"), "headroom/4": added("headroom/4", "torch"),
        "torch.amp": added("torch", "torch.amp"),
        "step_ratio": ratio("headroom", "torch"),
    }  # fmt: skip


def cold(seed: int, ds: Any, n: int = 31) -> dict:
    """Why a small operation costs more right after a backward pass on the CPU: 20 0-d tensor
    operations of one kind (``add_``) against 20 of ~16 kinds (the rule's mix), timed right
    after an fp16-autocast backward pass of the digits MLP (median of ``n - 1``) and warm (in a
    loop). Microseconds per 20 operations."""
    cfg = _cfg("digits", 10**6, seed)
    torch.manual_seed(seed)
    net = smodel.build(cfg, ds)
    batches = sdata.Batches(ds, cfg, 0, 1)
    a, two, hist = torch.ones(()), torch.full((), 2.0), torch.rand(50)

    def one_kind() -> None:
        for _ in range(20):
            a.add_(1)

    def many_kinds() -> None:
        x = a.clone()
        y = x.gt(0)
        x.add_(1).clamp_max_(5).mul_(y)
        z = x.masked_fill(y, 3.0) / two
        hist.copy_(torch.cat([hist[1:], z.reshape(1)]))
        peak = hist.max()
        t = torch.exp2(torch.floor(3 - torch.log2(peak))).clamp_(1, 100)
        torch.where(peak > 0, t, two, out=a)
        torch.stack([a > two, a < two])

    out = {}
    for name, f in (("one kind", one_kind), ("many kinds", many_kinds)):
        after = []
        for i in range(1, n):
            x, y = batches.get(i)
            net.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = _loss(net(x), y)
            loss.backward()
            t0 = time.perf_counter()
            f()
            after.append(time.perf_counter() - t0)
        f()
        t0 = time.perf_counter()
        for _ in range(200):
            f()
        warm = (time.perf_counter() - t0) / 200
        out[name] = (1e6 * sorted(after)[len(after) // 2], 1e6 * warm)
    return out


def cost_table(rows: list[dict]) -> str:
    """The markdown table of :func:`cost`'s rows."""
    lines = [
        "| task | AdamW | step, policy torch | step + update: torch.amp / torch / headroom "
        "| headroom's added time | measure_every=4 | shardscale vs torch.amp | whole steps, "
        "headroom / torch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r["calls_ms"]
        lines.append(
            f"| {r['task']} | {r['opt']} | {r['step_ms']:.2f} ms "
            f"| {c['torch.amp']:.3f} / {c['torch']:.3f} / {c['headroom']:.3f} ms "
            f"| {100 * r['headroom']:+.1f} % | {100 * r['headroom/4']:+.1f} % "
            f"| {100 * r['torch.amp']:+.1f} % | {r['step_ratio']:.3f} |"
        )
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    """The markdown table of ``rows`` (time as a ratio to torch gi2000 of the same row)."""
    base = {
        (r["task"], r["opt"], r["init_e"]): r["step_s"] for r in rows if r["scaler"] == SCALERS[0]
    }
    lines = [
        "| task | AdamW | scaler | init | skips 1-20 / after | step to 2**10 | mean log2 scale "
        "| underflow | test loss | test acc | time/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["step_s"] / base[(r["task"], r["opt"], r["init_e"])]
        uf = "-" if r["underflow"] is None else f"{r['underflow']:.1e}"
        lines.append(
            f"| {r['task']} | {r['opt']} | {r['scaler']} | 2**{r['init_e']} "
            f"| {r['skips_1_20']} / {r['skips_after']} | {r['reach10'] or 'never'} "
            f"| {r['mean_e']:.1f} | {uf} | {r['test_loss']:.3f} | {100 * r['test_acc']:.2f} % "
            f"| {ratio:.2f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """The scale trajectories (non-fused AdamW), one panel per (task, initial scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["task"], r["init_e"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 2.8), squeeze=False)
    for ax, (task, init) in zip(axes[0], panels, strict=True):
        for r in rows:
            if (r["task"], r["init_e"], r["opt"]) == (task, init, "adamw"):
                ax.plot(range(1, len(r["es"]) + 1), r["es"], label=r["scaler"], lw=1.2)
        ax.set_title(f"{task}, init 2**{init}", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("log2 scale", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="digits,text", help="digits,text")
    ap.add_argument("--opts", default="adamw,fused")
    ap.add_argument("--inits", default="0,16,24", help="log2 of the initial scales")
    ap.add_argument("--steps", type=int, default=300, help="digits steps")
    ap.add_argument("--text-steps", type=int, default=100, help="text steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default=None, help="write the scale trajectories to this PNG")
    ap.add_argument("--quick", action="store_true", help="digits, 12 steps, inits 0,24, adamw")
    ap.add_argument("--cost", action="store_true", help="only the paired time per step")
    ap.add_argument("--cold", action="store_true", help="only the cold-operation probe")
    ap.add_argument("--rounds", type=int, default=11, help="--cost: interleaved rounds")
    ap.add_argument("--per-round", type=int, default=5, help="--cost: steps per round")
    ap.add_argument("--device", default="cpu", help="--cost: the device (cpu, cuda)")
    a = ap.parse_args(argv)
    if a.quick:
        a.tasks, a.opts, a.inits, a.steps = "digits", "adamw", "0,24", 12
        a.rounds, a.per_round = 3, 2
    torch.set_num_threads(1)
    if a.cold:
        for name, (after, warm) in cold(a.seed, sdata.load(_cfg("digits", 10, a.seed))).items():
            print(
                f"20 ops of {name}: {after:.0f} us right after a backward pass, {warm:.0f} us warm"
            )
        return []
    if a.cost:
        rows = []
        for task in a.tasks.split(","):
            ds = sdata.load(_cfg(task, a.steps, a.seed))
            for opt in a.opts.split(","):
                rows.append(cost(task, opt == "fused", a.seed, ds, a.rounds, a.per_round, a.device))
        print(f"load average {os.getloadavg()[0]:.2f}, device {a.device}", file=sys.stderr)
        print(cost_table(rows))
        return rows
    rows = []
    for task in a.tasks.split(","):
        if task == "text" and not os.path.exists(TEXT):
            print(f"skipping text: {TEXT} not found", file=sys.stderr)
            continue
        steps = a.text_steps if task == "text" else a.steps
        ds = sdata.load(_cfg(task, steps, a.seed))
        run(task, False, SCALERS[0], 0, 3, a.seed, ds)  # warm-up: the first timed run is not slower
        for opt in a.opts.split(","):
            for init in map(int, a.inits.split(",")):
                for kind in SCALERS:
                    r = run(task, opt == "fused", kind, init, steps, a.seed, ds)
                    rows.append(r)
                    print(f"{task} {opt} {kind} 2**{init}: skips {r['skips_1_20']}/"
                          f"{r['skips_after']} mean log2 {r['mean_e']:.1f} acc "
                          f"{r['test_acc']:.4f}", file=sys.stderr, flush=True)  # fmt: skip
    print(table(rows))
    if a.plot:
        plot(rows, a.plot)
    return rows


if __name__ == "__main__":
    main()
