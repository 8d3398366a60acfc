"""Seeded randomized stress test of cross-rank agreement (2 CPU ranks, gloo).

Every rank runs the same sequence of *runs*. Each run draws (from a seed shared by all ranks) a
random policy (hysteresis, consecutive hysteresis, growth interval and factor, backoff factor,
bounds, ``dynamic``, ``max_consecutive_skips``), a tiny "model" of 2-7 parameters with random
dtypes (fp32/fp16/bf16) and sizes, split between two optimizers (``AdamW(fused=True)`` and a
plain ``SGD`` with momentum), and then trains: per step 1-4 micro-batches of gradient
accumulation, and with probability ~1/3 inf/NaN injected on a random rank into a random
parameter in one of six ways (inf or NaN loss term, NaN loss, inf/NaN written into ``.grad``,
a term too large for fp16 only) plus a harmless large term for fp32/bf16 parameters. Each rank
independently decides (its own RNG) whether to call ``unscale_`` before ``step`` for each
optimizer, so ranks take different code paths (scale folded into the fused kernel vs. unscaled
in place) and must still agree. The loss is linear in the parameters, so gradients are
``x * c * scale`` and the only overflows are the injected ones.

After every step the script checks, and raises ``AssertionError`` with the run, step, config
and injections on the first failure:

* the skip decision of each optimizer equals the injected pattern (an optimizer is skipped iff
  some rank injected a non-finite value into one of its parameters), and every collapse
  warning of ``update()`` names the first collapse the reference saw since the last warning,
  no later than ``POLL_EVERY`` updates after it (fused steps read nothing on the host);
* ``metrics()`` (scale, growth and hysteresis trackers, all six counters) equals
  the policy oracle of ``tests/_oracle.py`` fed with the number of overflowing optimizers;
* the parameters of a skipped optimizer are bitwise unchanged and finite;
* all ranks hold bitwise identical parameters, skip flags and scale (one ``all_gather``).

Usage (launched with torch's elastic launcher, the library behind ``torchrun``)::

    python benchmarks/stress.py --steps 10000            # the long version, ~1-2 min on 2 cores
    python benchmarks/stress.py --steps 300 --seed 7     # any seed reproduces exactly

The test suite runs a short version through ``tests/_dist.py`` (``tests/test_stress.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardscale import COUNTER_NAMES, ScalerConfig, ShardedGradScaler
from shardscale.scaler import POLL_EVERY

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _oracle import PyScaleState, reference_step  # noqa: E402  (the tests' policy oracle)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: kinds of injection -> whether they make the target's gradient non-finite
KINDS = {
    "inf_term": True,  # that parameter's loss term times inf
    "nan_term": True,  # ... times NaN
    "nan_loss": True,  # the whole micro-batch loss times NaN: every parameter with a gradient
    "grad_inf": True,  # inf written into .grad after the backward passes
    "grad_nan": True,  # NaN written into .grad
    "fp16_big": True,  # term times 1e30: finite in fp32, overflows the fp16 gradient cast
    "big_ok": False,  # term times 1e4 on an fp32/bf16 parameter (every rank): finite, not skipped
}


def _draw_config(rng: random.Random) -> dict[str, Any]:
    dynamic = rng.random() > 0.1
    min_exp, max_exp = rng.choice([-8, -2, 0]), rng.choice([10, 13])
    # max_scale <= 2**13: 4 micro-batches of |x| <= 1 stay finite in fp16 (< 65504).
    init = 2.0 ** rng.randint(min_exp, max_exp)
    return {
        "init_scale": init if dynamic else 1.0,
        "growth_factor": rng.choice([2.0, 2.0, 4.0]),
        "backoff_factor": rng.choice([0.5, 0.5, 0.25]),
        "growth_interval": rng.choice([1, 2, 3, 5, 8, 50]),
        "hysteresis": rng.choice([1, 1, 2, 3]),
        "consecutive_hysteresis": rng.random() < 0.5,
        "min_scale": 2.0**min_exp,
        "max_scale": 2.0**max_exp,
        "dynamic": dynamic,
        "max_consecutive_skips": rng.choice([None, None, 3]),
        "on_collapse": "warn",
    }


def _draw_injections(
    rng: random.Random, world_size: int, n_micro: int, dtypes: list[torch.dtype], present: list[int]
) -> list[tuple[int, int, int, str]]:
    """``[(rank, micro_batch, param_index, kind)]`` for one step."""
    out = []
    if not present or rng.random() > 0.35:
        return out
    for _ in range(rng.choice([1, 1, 1, 2])):
        p = rng.choice(present)
        kinds = ["inf_term", "nan_term", "nan_loss", "grad_inf", "grad_nan"]
        kinds.append("fp16_big" if dtypes[p] == torch.float16 else "big_ok")
        out.append((rng.randrange(world_size), rng.randrange(n_micro), p, rng.choice(kinds)))
    return out


def _one_run(
    rank: int, world_size: int, run_seed: int, steps: int, stats: Counter, check_every: int = 1
) -> None:
    shared = random.Random(run_seed)  # identical on every rank
    local = random.Random(run_seed * 7919 + rank)  # this rank's own choices (unscale_ use)
    kw = _draw_config(shared)
    cfg = ScalerConfig(**{k: v for k, v in kw.items() if k != "init_scale"})
    n_params = shared.randint(2, 7)
    dtypes = [shared.choice(DTYPES) for _ in range(n_params)]
    sizes = [shared.randint(1, 8) for _ in range(n_params)]
    split = shared.randint(1, n_params - 1)  # params [0, split) -> AdamW, the rest -> SGD
    gen = torch.Generator().manual_seed(run_seed)
    params = [
        torch.nn.Parameter(torch.randn(n, generator=gen).to(dt))
        for n, dt in zip(sizes, dtypes, strict=True)
    ]
    owner = [0 if i < split else 1 for i in range(n_params)]
    opts = [
        torch.optim.AdamW(params[:split], lr=1e-3, fused=True),
        torch.optim.SGD(params[split:], lr=1e-2, momentum=0.9),
    ]
    scaler = ShardedGradScaler("cpu", **kw)
    ref = PyScaleState(kw["init_scale"], 0, cfg.hysteresis)
    unreported: list[int] = []  # steps at which the reference collapsed, not yet warned of
    stats["runs"] += 1
    for step in range(steps):
        n_micro = shared.randint(1, 4)
        present = [i for i in range(n_params) if shared.random() > 0.1]
        inj = _draw_injections(shared, world_size, n_micro, dtypes, present)
        # x = +-k/64, k in 1..64: scaled gradients and their fp16/bf16 sums are exact, never
        # zero (a 0 would hide an inf term) and never fp16-subnormal once unscaled, so the fused
        # in-kernel unscale and the in-place unscale_ give bitwise equal parameters.
        xs = [
            [
                torch.randint(1, 65, (n,), generator=gen).float()
                / 64
                * (torch.randint(0, 2, (n,), generator=gen) * 2 - 1)
                for n in sizes
            ]
            for _ in range(n_micro)
        ]
        order = [0, 1] if shared.random() < 0.5 else [1, 0]
        unscale_first = shared.random() < 0.5  # all unscale_ calls before the steps
        # Each rank decides for itself whether to unscale_ first, which is safe when each
        # optimizer's unscale_ directly precedes its step: the per-optimizer all-reduces are
        # then issued in the same optimizer order on every rank. With all unscale_ calls first,
        # the choice must be the same on every rank (else rank 0 could reduce A's flag against
        # rank 1's B flag): that pattern uses the shared RNG.
        if unscale_first:
            use_unscale = [shared.random() < 0.5 for _ in opts]
        else:
            use_unscale = [local.random() < 0.5 for _ in opts]

        for opt in opts:
            opt.zero_grad(set_to_none=True)
        scaled = False  # the same on every rank (present and the terms come from shared draws)
        for mb in range(n_micro):
            terms = []
            nan_loss = False
            for i in present:
                c = 1.0
                for r, m, p, kind in inj:
                    # big_ok is finite: applied on every rank, or replicas would diverge
                    if (r == rank or kind == "big_ok") and m == mb and p == i:
                        c *= {
                            "inf_term": float("inf"),
                            "nan_term": float("nan"),
                            "fp16_big": 1e30,
                            "big_ok": 1e4,
                        }.get(kind, 1.0)
                nan_loss |= any(r == rank and m == mb and k == "nan_loss" for r, m, _, k in inj)
                terms.append((params[i].float() * xs[mb][i]).sum() * c)
            if not terms:
                continue
            loss = torch.stack(terms).sum()
            if nan_loss:
                loss = loss * float("nan")
            scaler.scale(loss).backward()
            scaled = True
        for r, _, p, kind in inj:
            if r == rank and kind in ("grad_inf", "grad_nan") and params[p].grad is not None:
                params[p].grad.view(-1)[0] = float("inf" if kind == "grad_inf" else "nan")

        # expected overflow per optimizer
        bad = [False, False]
        for _, _, p, kind in inj:
            if kind == "nan_loss":
                for i in present:
                    bad[owner[i]] = True
            elif KINDS[kind]:
                bad[owner[p]] = True
            stats[f"inject_{kind}"] += 1

        before = [[q.detach().clone() for q in o.param_groups[0]["params"]] for o in opts]
        if unscale_first:
            for k in order:
                if use_unscale[k]:
                    scaler.unscale_(opts[k])
            for k in order:
                scaler.step(opts[k])
        else:
            for k in order:
                if use_unscale[k]:
                    scaler.unscale_(opts[k])
                scaler.step(opts[k])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scaler.update()
        warned = [str(w.message) for w in caught if "collapsed" in str(w.message)]
        # an iteration with no scale() on any rank is not counted (no loss: nothing to scale)
        ref, ref_collapsed = reference_step(ref, sum(bad), cfg) if scaled else (ref, False)
        if ref_collapsed:
            unreported.append(ref.counters[0] - 1)

        skipped = [bool(scaler.last_step_skipped(o)) for o in opts]
        ctx = f"run_seed={run_seed} step={step} rank={rank} config={kw} injections={inj}"
        assert skipped == bad, f"skip decisions {skipped} != injected {bad}: {ctx}"
        if warned:
            assert len(warned) == 1 and unreported, f"collapse warnings {warned}: {ctx}"
            assert f"at step {unreported[0]} " in warned[0], f"{warned} vs {unreported}: {ctx}"
            unreported = []
        assert not unreported or unreported[0] > ref.counters[0] - 1 - POLL_EVERY, ctx
        m = scaler.metrics()
        got = (m["scale"], m["growth_tracker"], m["hysteresis_tracker"]) + tuple(
            m[n] for n in COUNTER_NAMES
        )
        want = (ref.scale, ref.growth_tracker, ref.hysteresis_tracker) + ref.counters
        assert got == want, f"state {got} != reference {want}: {ctx}"
        for k, o in enumerate(opts):
            for q, b in zip(o.param_groups[0]["params"], before[k], strict=True):
                assert torch.isfinite(q).all(), f"non-finite parameter: {ctx}"
                if skipped[k]:
                    assert torch.equal(q, b), f"optimizer {k} skipped but changed: {ctx}"
        if step % check_every == 0 or step == steps - 1:
            mine = torch.cat(
                [torch.tensor([float(s) for s in skipped] + [m["scale"]], dtype=torch.float64)]
                + [q.detach().double().flatten() for q in params]
            )
            everyone = [torch.empty_like(mine) for _ in range(world_size)]
            dist.all_gather(everyone, mine)
            for r, theirs in enumerate(everyone):
                assert torch.equal(theirs, mine), f"rank {r} disagrees with rank {rank}: {ctx}"
        stats["steps"] += 1
        stats["skipped_adamw"] += skipped[0]
        stats["skipped_sgd"] += skipped[1]
        stats["collapse_warnings"] += len(warned)
        stats["unscale_calls"] += sum(use_unscale)
    stats["final_backoffs"] += ref.counters[4]
    stats["final_growths"] += ref.counters[5]


def worker(
    rank: int, world_size: int, seed: int, steps: int, steps_per_run: int, progress: bool = False
) -> dict[str, int]:
    """Run ``steps`` scaler steps in runs of ``steps_per_run``; return counts (per rank).

    ``fn(rank, world_size, ...)`` signature of ``tests/_dist.run_ranks``; needs an initialized
    default process group. Raises AssertionError on the first disagreement.
    """
    torch.set_num_threads(1)
    stats: Counter = Counter()
    bar = None
    if progress and rank == 0:
        try:
            from tqdm import tqdm

            bar = tqdm(total=steps, unit="step", desc="stress")
        except ImportError:  # pragma: no cover
            bar = None
    done, run = 0, 0
    while done < steps:
        n = min(steps_per_run, steps - done)
        _one_run(rank, world_size, seed * 100_003 + run, n, stats)
        done += n
        run += 1
        if bar is not None:
            bar.update(n)
    if bar is not None:
        bar.close()
    return dict(stats)


def _entry(seed: int, steps: int, steps_per_run: int) -> dict[str, int]:
    """Elastic-launcher entry point: env:// rendezvous set up by the launcher."""
    dist.init_process_group("gloo")
    try:
        return worker(
            dist.get_rank(), dist.get_world_size(), seed, steps, steps_per_run, progress=True
        )
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, launch ``--nproc`` ranks with torch's elastic launcher, print a summary."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10_000, help="total scaler steps (all runs)")
    ap.add_argument("--steps-per-run", type=int, default=250, help="steps per random config")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nproc", type=int, default=2, help="ranks (CPU processes, gloo)")
    ap.add_argument("--json", default=None, help="also write the summary to this file")
    args = ap.parse_args(argv)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=args.nproc,
        run_id=f"shardscale-stress-{os.getpid()}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # as torchrun --standalone: a free port
        max_restarts=0,
        start_method="spawn",
    )
    t0 = time.perf_counter()
    results = elastic_launch(config, _entry)(args.seed, args.steps, args.steps_per_run)
    elapsed = time.perf_counter() - t0
    per_rank = [results[r] for r in sorted(results)]
    summary = {
        "ok": True,
        "seed": args.seed,
        "ranks": args.nproc,
        "torch": torch.__version__,
        "wall_s": round(elapsed, 1),
        **per_rank[0],
    }
    assert all(p["steps"] == per_rank[0]["steps"] for p in per_rank)
    print(json.dumps(summary, indent=1, sort_keys=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
