"""One-shot CUDA check for shardscale: correctness on the GPU, sync counts, and the benchmark.

Run on a CUDA machine (finishes in well under 5 minutes on one recent GPU)::

    python benchmarks/gpu_check.py            # checks + benchmark (10M/50M/100M, fp32/fp16/bf16)
    python benchmarks/gpu_check.py --quick    # checks + a small benchmark

What it does:

1. Parity on CUDA: shardscale vs ``torch.amp.GradScaler("cuda")`` over a few training steps with
   autocast fp16 (parameters equal), with fp16 parameters (vs a hand-written fp32 reference),
   with ``AdamW(fused=True)``, ``clip_grad_norm_`` vs torch's unscale_+clip recipe, gradients
   on CUDA next to CPU-offloaded ones, the policy's device ops vs the plain-Python oracle of
   ``tests/_oracle.py``, the collapse guard (read at once, or polled with fused steps), and
   ``policy="headroom"``'s scales against the rule applied by hand to the measured amax.
2. Host syncs per iteration measured by CUDA itself (``torch.cuda.set_sync_debug_mode("warn")``):
   expected 0 with a fused optimizer, 1 otherwise (the skip decision), also on the clip path.
3. ``policy="headroom"``'s cost in real fp16 training on CUDA (``benchmarks/policies.py --cost
   --device cuda``: the digits MLP and the character transformer, AdamW fused and not; target:
   the headroom policy's added time at most 2 % of a step, whole steps in the last column).
4. The ``benchmarks/bench.py`` table on CUDA, plus unscale bandwidth vs a measured device-to-device
   copy of the same bytes (target: unscale >= 90% of the copy bandwidth), both by wall clock
   (host overhead included) and by the kernels' device time from the torch profiler.

Without CUDA it runs a CPU smoke check of the same parity code and exits 0 with a message.
Exit status: 0 when every check passed (targets that are missed are reported, not failed), 1 if
a correctness check failed.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from shardscale import ScalerConfig, ScaleState, ShardedGradScaler, next_state

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent / "tests"))
from _oracle import PyScaleState, reference_step  # noqa: E402  (the tests' policy oracle)


def _load(name: str, file: str):
    """The benchmark script ``file`` beside this one, imported as ``name``."""
    spec = importlib.util.spec_from_file_location(name, _HERE / file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _load("gpu_check_bench", "bench.py")


def _model(device: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64), torch.nn.Linear(64, 8)
    )
    return m.to(device=device, dtype=dtype)


def parity_autocast(device: str, fused: bool, clip: bool, steps: int = 6) -> float:
    """Max |param difference| between shardscale and torch.amp.GradScaler after ``steps``."""
    a = _model(device)
    b = copy.deepcopy(a)
    oa = torch.optim.AdamW(a.parameters(), lr=1e-3, fused=fused)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-3, fused=fused)
    sa = ShardedGradScaler(device, init_scale=2.0**14, growth_interval=2)
    sb = torch.amp.GradScaler(device, init_scale=2.0**14, growth_interval=2)
    amp_dtype = torch.float16 if device == "cuda" else torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(1)
    for i in range(steps):
        x = torch.randn(32, 64, generator=g).to(device)
        if i == 2:
            x[0, 0] = float("inf")  # one overflowing step: both must skip and back off
        for m, o, s in ((a, oa, sa), (b, ob, sb)):
            o.zero_grad()
            with torch.autocast(device_type=device, dtype=amp_dtype):
                loss = m(x).float().pow(2).mean()
            s.scale(loss).backward()
            if clip:
                if s is sa:
                    sa.clip_grad_norm_(oa, 0.1)
                else:
                    sb.unscale_(ob)
                    torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1)
            s.step(o)
            s.update()
    assert sa.get_scale() == sb.get_scale(), (sa.get_scale(), sb.get_scale())
    return max(
        (p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


def parity_fp16_params(device: str) -> float:
    """fp16 parameters and gradients (torch's GradScaler refuses them): vs a float64 reference."""
    m = _model(device, torch.float16)
    ref = [p.detach().double().clone() for p in m.parameters()]
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    s = ShardedGradScaler(device, init_scale=1024.0)
    x = torch.randn(16, 64, device=device, dtype=torch.float16)
    s.scale(m(x).float().pow(2).mean()).backward()
    grads = [p.grad.double() / 1024.0 for p in m.parameters()]
    s.step(opt)
    s.update()
    return max(
        (p.double() - (r - 0.1 * g)).abs().max().item()
        for p, r, g in zip(m.parameters(), ref, grads, strict=True)
    )


def headroom_by_hand(device: str, fused: bool, clip: bool, steps: int = 8) -> tuple[bool, str]:
    """``policy="headroom"`` on ``device`` (its amax from ``_foreach_norm(inf)`` off the CPU):
    each update's scale is the rule applied by hand to the largest |gradient| read before the
    step, ``2**floor(log2(65504 / max(history)) - 3)`` (no overflow here, from 2**0)."""
    m = _model(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=fused)
    s = ShardedGradScaler(device, init_scale=1.0, policy="headroom")
    amp_dtype = torch.float16 if device == "cuda" else torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(2)
    history: list[float] = []
    for i in range(steps):
        x = torch.randn(32, 64, generator=g).to(device)
        opt.zero_grad()
        with torch.autocast(device_type=device, dtype=amp_dtype):
            loss = m(x).float().pow(2).mean()
        scale = s.get_scale()
        s.scale(loss).backward()
        history.append(max(p.grad.abs().max().item() for p in m.parameters()) / scale)
        if clip:
            s.clip_grad_norm_(opt, 1e9)  # measures the amax in its own read pass
        s.step(opt)
        s.update()
        expected = 2.0 ** math.floor(math.log2(65504.0 / max(history[-50:])) - 3.0)
        if s.last_step_skipped(opt) or s.get_scale() != max(expected, 1.0):
            return False, f"step {i}: scale {s.get_scale()}, by hand {expected}"
    return True, f"{steps} steps from 2**0 to 2**{math.log2(s.get_scale()):g}"


def count_syncs(device: str, fused: bool, clip: bool, policy: str = "torch") -> int:
    """CUDA host syncs in one steady-state iteration (scale, [clip], step, update)."""
    m = _model(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=fused, capturable=not fused)
    s = ShardedGradScaler(device, policy=policy)
    x = torch.randn(8, 64, device=device)

    def iteration() -> None:
        opt.zero_grad()
        s.scale(m(x).pow(2).mean()).backward()
        if clip:
            s.clip_grad_norm_(opt, 1.0)
        s.step(opt)
        s.update()

    iteration()
    iteration()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            iteration()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def parity_mixed_devices(steps: int = 6) -> float:
    """Gradients on CUDA next to CPU-offloaded ones (one model split across devices): vs
    torch.amp.GradScaler("cuda") (per-device found_inf); an inf in the CPU half at step 2."""
    torch.manual_seed(0)
    gpu, cpu = torch.nn.Linear(32, 32).cuda(), torch.nn.Linear(32, 8)
    twins = [(gpu, cpu), (copy.deepcopy(gpu), copy.deepcopy(cpu))]
    opts = [torch.optim.SGD([*g.parameters(), *c.parameters()], lr=0.1) for g, c in twins]
    scalers = [ShardedGradScaler("cuda", init_scale=256.0), torch.amp.GradScaler("cuda", 256.0)]
    for i in range(steps):
        x = torch.randn(4, 32, device="cuda")
        for (g, c), o, s in zip(twins, opts, scalers, strict=True):
            o.zero_grad()
            loss = c(g(x).cpu()).pow(2).mean().cuda()  # the scale lives on CUDA
            if i == 2:
                loss = (
                    loss + (c.bias.sum() * float("inf")).cuda()
                )  # non-finite grads on the CPU side
            s.scale(loss).backward()
            s.step(o)
            s.update()
    assert scalers[0].get_scale() == scalers[1].get_scale() == 128.0
    return max(
        (p - q.to(p.device)).abs().max().item()
        for (g0, c0), (g1, c1) in [twins]
        for p, q in zip(
            [*g0.parameters(), *c0.parameters()], [*g1.parameters(), *c1.parameters()], strict=True
        )
    )


def policy_kernels_match_reference(steps: int = 200) -> bool:
    """next_state on CUDA (device ops) equals the plain-Python oracle bit for bit."""
    cfg = ScalerConfig(
        growth_factor=1.7,
        backoff_factor=0.3,
        growth_interval=3,
        hysteresis=2,
        min_scale=0.01,
        max_scale=1e6,
        max_consecutive_skips=4,
    )
    g = torch.Generator().manual_seed(0)
    state = ScaleState.create(torch.device("cuda"), 1000.0, 0, 2, (0,) * 6)
    ref = PyScaleState(1000.0, 0, 2, (0,) * 6)
    for _ in range(steps):
        found = (
            int(torch.randint(0, 3, (), generator=g)) if torch.rand((), generator=g) < 0.3 else 0
        )
        new, collapsed = next_state(state, torch.tensor(float(found), device="cuda"), cfg)
        state.copy_from(new)
        ref, ref_collapsed = reference_step(ref, found, cfg)
        if (
            state.scale.item() != ref.scale
            or state.growth_tracker.item() != ref.growth_tracker
            or state.hysteresis_tracker.item() != ref.hysteresis_tracker
            or tuple(state.counters.tolist()) != ref.counters
            or bool(collapsed) != ref_collapsed
        ):
            return False
    return True


def collapse_raises_on_cuda(fused: bool = False) -> tuple[bool, str]:
    """The collapse guard raises ScaleCollapseError on CUDA for the collapse at step 2: at once
    with a non-fused optimizer (its step read the overflow), within ``POLL_EVERY`` (16) updates
    with a fused one (no host read: the alarm is polled)."""
    from shardscale import ScaleCollapseError

    m = _model("cuda")
    params = list(m.parameters())
    opt = (
        torch.optim.AdamW(params, lr=0.1, fused=True) if fused else torch.optim.SGD(params, lr=0.1)
    )
    s = ShardedGradScaler("cuda", init_scale=4.0, max_consecutive_skips=3)
    x = torch.randn(4, 64, device="cuda")
    last = 2 + 16 if fused else 2
    for i in range(24):
        opt.zero_grad()
        s.scale(m(x).sum() * float("nan")).backward()
        s.step(opt)
        try:
            s.update()
        except ScaleCollapseError as e:
            ok = e.step == 2 and i <= last
            return ok, f"raised at update {i} (<= {last}) for step {e.step}: {str(e)[:60]}..."
        torch.cuda.synchronize()
    return False, "no ScaleCollapseError after 24 NaN steps"


def shared_memory_grad_refused_on_cuda() -> tuple[bool, str]:
    """An expanded CUDA gradient after a good one: unscale_ refuses it naming the parameter,
    before unscaling the good one (the accelerator path's check); after the fix it steps."""
    good = torch.nn.Parameter(torch.zeros(3, device="cuda"))
    bad = torch.nn.Parameter(torch.zeros(4, 4, device="cuda"))
    opt = torch.optim.SGD([good, bad], lr=1.0)
    s = ShardedGradScaler("cuda", init_scale=4.0, param_names={"good": good, "bad": bad})
    s.scale(torch.tensor(1.0, device="cuda"))
    good.grad = torch.full((3,), 4.0, device="cuda")
    bad.grad = torch.tensor([4.0], device="cuda").expand(4, 4)
    try:
        s.unscale_(opt)
        return False, "an expanded gradient was accepted"
    except ValueError as e:
        if "gradient of bad" not in str(e) or not bool((good.grad == 4.0).all()):
            return False, f"wrong message or the good gradient was written: {e}"
    bad.grad = torch.full((4, 4), 4.0, device="cuda")
    s.step(opt)
    s.update()
    ok = bool((good == -1.0).all()) and bool((bad == -1.0).all())
    return ok, "refused before writing, named; stepped after the fix" if ok else "wrong step"


def copy_vs_unscale(numel: int, dtype: torch.dtype, rounds: int = 20) -> tuple[float, float]:
    """(unscale GB/s, device-to-device copy GB/s) over the same GPT-2-shaped gradient bytes."""
    gs = bench.GradSet(numel, dtype, torch.device("cuda"))
    dst = [torch.empty_like(g) for g in gs.grads]
    opt = gs.optimizer("sgd")
    scaler = ShardedGradScaler("cuda", init_scale=bench.SCALE, growth_interval=2**30)
    scaler.scale(torch.ones((), device="cuda"))
    t_copy, t_unscale = [], []
    for _ in range(rounds + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch._foreach_copy_(dst, gs.grads)
        torch.cuda.synchronize()
        t_copy.append(time.perf_counter() - t0)
        gs.restore()  # the scaled gradients back (untimed)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        scaler.unscale_(opt)
        torch.cuda.synchronize()
        t_unscale.append(time.perf_counter() - t0)
        scaler.update()
        scaler.scale(torch.ones((), device="cuda"))  # the next iteration's gradients are scaled
    nbytes = 2 * gs.nbytes
    return nbytes / statistics.median(t_unscale[2:]) / 1e9, nbytes / statistics.median(
        t_copy[2:]
    ) / 1e9


def kernel_bandwidth(numel: int, dtype: torch.dtype, rounds: int = 10) -> tuple[float, float]:
    """(unscale GB/s, copy GB/s) from the *device* time of the kernels alone (torch profiler),
    so per-call host overhead (launches, Python) does not count: the kernel-level comparison
    the target is about. Summed over ``rounds`` calls of ``unscale_`` and ``_foreach_copy_``."""
    from torch.profiler import ProfilerActivity, profile

    gs = bench.GradSet(numel, dtype, torch.device("cuda"))
    dst = [torch.empty_like(g) for g in gs.grads]
    opt = gs.optimizer("sgd")
    scaler = ShardedGradScaler("cuda", init_scale=bench.SCALE, growth_interval=2**30)
    scaler.scale(torch.ones((), device="cuda"))
    for _ in range(2):  # warm-up
        scaler.unscale_(opt)
        scaler.update()
        scaler.scale(torch.ones((), device="cuda"))
        torch._foreach_copy_(dst, gs.grads)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            torch._foreach_copy_(dst, gs.grads)
            scaler.unscale_(opt)
            scaler.update()
            scaler.scale(torch.ones((), device="cuda"))  # not among the kernels summed below
        torch.cuda.synchronize()

    def device_us(op: str) -> float:
        for e in prof.key_averages():
            if e.key == op:
                return float(getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0))
        return float("nan")

    nbytes = 2 * gs.nbytes * rounds
    u = device_us("aten::_amp_foreach_non_finite_check_and_unscale_")
    c = device_us("aten::_foreach_copy_")
    return nbytes / (u * 1e-6) / 1e9, nbytes / (c * 1e-6) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small benchmark sizes")
    args = parser.parse_args(argv)
    failures: list[str] = []

    def check(name: str, ok: bool, detail: str) -> None:
        print(f"[{'ok' if ok else 'FAIL'}] {name}: {detail}")
        if not ok:
            failures.append(name)

    if not torch.cuda.is_available():
        diff = parity_autocast("cpu", fused=False, clip=True, steps=3)
        check("cpu smoke: clip parity vs torch recipe", diff < 1e-5, f"max |dp| = {diff:.2e}")
        print("CUDA is not available: GPU checks and the CUDA benchmark were skipped.")
        return 1 if failures else 0

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for fused in (False, True):
        for clip in (False, True):
            diff = parity_autocast("cuda", fused, clip)
            check(f"parity autocast fp16 fused={fused} clip={clip}", diff < 1e-5, f"{diff:.2e}")
    diff = parity_fp16_params("cuda")
    check("fp16 params vs fp64 reference", diff < 2e-3, f"max |dp| = {diff:.2e}")
    diff = parity_mixed_devices()
    check("CUDA + CPU-offloaded grads vs torch GradScaler", diff < 1e-6, f"max |dp| = {diff:.2e}")
    check("next_state on CUDA == the Python oracle", policy_kernels_match_reference(), "200 steps")
    for fused in (False, True):
        ok, detail = collapse_raises_on_cuda(fused)
        check(f"collapse guard on CUDA fused={fused}", ok, detail)
    ok, detail = shared_memory_grad_refused_on_cuda()
    check("expanded CUDA gradient refused before any write", ok, detail)
    for fused in (False, True):
        for clip in (False, True):
            ok, detail = headroom_by_hand("cuda", fused, clip)
            check(f"policy='headroom' by hand fused={fused} clip={clip}", ok, detail)
    for policy in ("torch", "headroom"):
        for fused, clip, expect in (
            (True, False, 0),
            (True, True, 0),
            (False, False, 1),
            (False, True, 1),
        ):
            n = count_syncs("cuda", fused, clip, policy)
            name = f"host syncs policy={policy} fused={fused} clip={clip}"
            check(name, n <= expect, f"{n} (target <= {expect})")

    print("\npolicy='headroom' cost on CUDA (benchmarks/policies.py --cost --device cuda):")
    try:
        policies = _load("gpu_check_policies", "policies.py")
        policies.main(["--cost", "--device", "cuda", "--rounds", "5" if args.quick else "21"])
    except Exception as e:  # report, keep going (e.g. scikit-learn missing: the [train] extra)
        print(f"  n/a ({type(e).__name__}: {e})")

    sizes = [2_000_000, 10_000_000] if args.quick else [10_000_000, 50_000_000, 100_000_000]
    cfg = bench.Config(sizes=sizes, dtypes=["fp32", "fp16", "bf16"], rounds=10, device="cuda")
    rows = bench.run(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(bench.format_table(rows))
    print(bench.summary(rows))
    print("\nunscale vs device-to-device copy (same bytes, read+write):")
    for numel in sizes:
        for dname in ("fp32", "fp16", "bf16"):
            try:
                u, c = copy_vs_unscale(numel, bench.DTYPES[dname])
                ku, kc = kernel_bandwidth(numel, bench.DTYPES[dname])
            except Exception as e:  # report, keep going: the remaining rows still print
                print(f"  {numel / 1e6:g}M {dname}: n/a ({type(e).__name__}: {e})")
                continue
            flag = "met" if ku >= 0.9 * kc else "MISSED"
            print(
                f"  {numel / 1e6:g}M {dname}: wall clock (incl. host overhead) unscale {u:.0f} "
                f"GB/s, copy {c:.0f} GB/s, {100 * u / c:.0f}%; kernels only (profiler) unscale "
                f"{ku:.0f} GB/s, copy {kc:.0f} GB/s, {100 * ku / kc:.0f}% (target >= 90%: {flag})"
            )
    if failures:
        print(f"FAILED: {failures}")
        return 1
    print("all correctness checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
