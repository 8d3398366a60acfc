"""The compiled CPU unscale kernel (``_cpukernel``): bit for bit torch's kernel, on any thread
count and split, and its fallback/selection rules (``SHARDSCALE_CPU_KERNEL``, cache)."""

from __future__ import annotations

import ctypes
import math
import os
import shutil
import tempfile
from array import array
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardscale import ShardedGradScaler, _cpukernel

INT = {
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float64: torch.int64,
}
FACTORS = [1.0, 0.5, 2.0**-16, 1 / 3, 3.7e-3, 7.0, 1e30, 2.0**-140]


@pytest.fixture(autouse=True)
def every_size_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Writes to tensors of any size and number go through the compiled kernel here (by default
    only ``_SMALL_CAP`` tensors under ``_SMALL`` elements do), so tails and tiny tensors are
    tested."""
    monkeypatch.setattr(_cpukernel, "_SMALL", 0)


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[_cpukernel.KernelStatus]:
    """The compiled kernel, loaded (the test is skipped where it cannot be built: no C compiler
    or no OpenMP; shardscale then runs on torch's kernels, which the rest of the suite covers)."""
    monkeypatch.setenv(_cpukernel.ENV, "auto")
    _cpukernel.reset()
    status = _cpukernel.status()
    if not status.available:
        pytest.skip(f"compiled CPU kernel unavailable here: {status.reason}")
    yield status
    _cpukernel.reset()


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path) -> Iterator[pytest.MonkeyPatch]:
    """An empty kernel cache and a forgotten kernel; restored afterwards."""
    monkeypatch.setenv(_cpukernel.CACHE_ENV, str(tmp_path / "cache"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # gettempdir() is cached
    _cpukernel.reset()
    yield monkeypatch
    _cpukernel.reset()


def _fake_cc(path: Path, body: str) -> Path:
    """An executable shell script standing in for the C compiler: answers ``--version``, then
    runs ``body`` for the build."""
    path.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then echo fake 1.0; exit 0; fi\n{body}\n')
    path.chmod(0o755)
    return path


def _specials(dtype: torch.dtype) -> torch.Tensor:
    info = torch.finfo(dtype)
    vals = [0.0, -0.0, info.tiny, -info.tiny, info.tiny / 4, info.max, -info.max, info.eps, 1.0]
    return torch.tensor(vals, dtype=torch.float32).to(dtype)


def _both(grads: list[torch.Tensor], inv: float, found: float = 0.0):
    """(torch's result, ours) on copies of ``grads``: lists of tensors and the found_inf values."""
    a = [g.clone() for g in grads]
    b = [g.clone() for g in grads]
    fa, fb = torch.tensor(found), torch.tensor(found)
    torch._amp_foreach_non_finite_check_and_unscale_(a, fa, torch.tensor(inv))
    _cpukernel.foreach_unscale_(b, fb, torch.tensor(inv))
    return (a, fa.item()), (b, fb.item())


def _assert_same(grads: list[torch.Tensor], inv: float, found: float = 0.0) -> None:
    (a, fa), (b, fb) = _both(grads, inv, found)
    assert fa == fb
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.isnan(), y.isnan())
        keep = ~x.isnan()
        assert torch.equal(x[keep].view(INT[x.dtype]), y[keep].view(INT[y.dtype]))  # bitwise


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threads", [1, 2])
def test_bitwise_equal_to_torch_kernel(kernel, dtype, threads) -> None:
    assert dtype in kernel.dtypes or dtype == torch.float16
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        for inv in FACTORS:
            grads = [torch.randn(n, generator=gen).mul_(300.0).to(dtype) for n in (1, 7, 31, 1000)]
            grads += [torch.randn(300_001, generator=gen).to(dtype), _specials(dtype)]
            _assert_same(grads, inv)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_found_anywhere(kernel, dtype, bad) -> None:
    # first/last element, both sides of the 2-thread split (total 400_010 -> 200_005), a tail
    sizes = (150_000, 100_003, 150_007)
    for tensor, pos in [(0, 0), (0, 149_999), (1, 50_004), (1, 50_005), (2, 150_006), (2, 3)]:
        for inv in (1.0, 0.25):
            grads = [torch.ones(n, dtype=dtype) for n in sizes]
            grads[tensor][pos] = bad
            found = torch.zeros(())
            _cpukernel.foreach_unscale_(grads, found, torch.tensor(inv))
            assert found.item() == 1.0, (tensor, pos, inv)
            rest = torch.cat([g.float() for g in grads])
            assert int(torch.isfinite(rest).logical_not().sum()) == 1
            assert (rest[torch.isfinite(rest)] == inv).all()
    grads = [torch.ones(n, dtype=dtype) for n in sizes]
    found = torch.zeros(())
    _cpukernel.foreach_unscale_(grads, found, torch.tensor(0.5))
    assert found.item() == 0.0


def test_found_inf_is_never_cleared(kernel) -> None:
    grads = [torch.ones(1000)]
    found = torch.ones(())
    _cpukernel.foreach_unscale_(grads, found, torch.tensor(0.5))
    assert found.item() == 1.0 and (grads[0] == 0.5).all()


def test_factor_one_leaves_bits_alone(kernel) -> None:
    # a NaN payload survives: nothing is written when the factor is 1 (check only)
    g = torch.tensor([0x7FA00001, 0x3F800000], dtype=torch.int32).view(torch.float32)
    found = torch.zeros(())
    _cpukernel.foreach_unscale_([g], found, torch.tensor(1.0))
    assert g.view(torch.int32).tolist() == [0x7FA00001, 0x3F800000] and found.item() == 1.0


def test_non_contiguous_and_mixed_lists_fall_back(kernel) -> None:
    base = torch.randn(64, 64)
    grads = [base.t(), torch.randn(10), torch.randn(5).to(torch.float64)[:0].float()]
    grads[1][3] = float("inf")
    _assert_same(grads, 0.5)
    # float64 has no compiled path: torch's kernel, same answer
    _assert_same([torch.randn(100, dtype=torch.float64)], 0.125)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    bits=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=300),
    inv=st.sampled_from(FACTORS + [2.0**-24, 65504.0]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_any_bit_pattern(bits, inv, dtype) -> None:
    if not _cpukernel.status().available:
        pytest.skip("compiled CPU kernel unavailable")
    raw = torch.tensor(bits, dtype=torch.int32)
    g = raw.view(torch.float32) if dtype == torch.float32 else raw.to(torch.int16).view(dtype)
    _assert_same([g, g[: len(g) // 2].clone()], inv)


def test_scaler_steps_identical_with_and_without_kernel(monkeypatch) -> None:
    """Several bf16/fp32 steps with growth and an overflow: same parameters bit for bit."""

    def train() -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.Linear(300, 3))
        model[1].to(torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ShardedGradScaler(init_scale=2.0**10, growth_interval=2)
        for i in range(6):
            x = torch.randn(8, 40)
            loss = model[1](model[0](x).to(torch.bfloat16)).float().pow(2).mean()
            if i == 3:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()] + [scaler.get_scale()]

    runs = []
    for mode in ("1", "0"):
        monkeypatch.setenv(_cpukernel.ENV, mode)
        _cpukernel.reset()
        try:
            runs.append(train())
        except _cpukernel.CpuKernelError:
            pytest.skip("compiled CPU kernel unavailable")
    _cpukernel.reset()
    for a, b in zip(*runs, strict=True):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))


def test_mode_zero_uses_torch(fresh) -> None:
    fresh.setenv(_cpukernel.ENV, "0")
    st_ = _cpukernel.status()
    assert not st_.available and _cpukernel.ENV in st_.reason
    _assert_same([torch.randn(100)], 0.5)


def test_required_kernel_without_compiler_raises(fresh) -> None:
    fresh.setenv(_cpukernel.ENV, "1")
    fresh.setenv("CC", "/nonexistent/cc")
    with pytest.raises(_cpukernel.CpuKernelError, match="SHARDSCALE_CPU_KERNEL=1.*does not run"):
        _cpukernel.status()


def test_auto_without_compiler_falls_back(fresh, caplog) -> None:
    fresh.setenv(_cpukernel.ENV, "auto")
    fresh.setenv("CC", "/nonexistent/cc")
    with caplog.at_level("INFO", logger="shardscale"):
        st_ = _cpukernel.status()
    assert not st_.available and "does not run" in st_.reason
    assert "using torch's" in caplog.text
    g = [torch.tensor([1.0, float("inf")])]
    found = torch.zeros(())
    _cpukernel.foreach_unscale_(g, found, torch.tensor(0.5))  # torch's kernel
    assert found.item() == 1.0 and g[0][0].item() == 0.5


def test_compiler_error_is_reported(fresh, tmp_path) -> None:
    fake = _fake_cc(tmp_path / "fakecc", "echo 'boom: no openmp' >&2; exit 1")
    fresh.setenv(_cpukernel.ENV, "1")
    fresh.setenv("CC", str(fake))
    with pytest.raises(_cpukernel.CpuKernelError, match="boom: no openmp"):
        _cpukernel.status()
    assert not list((tmp_path / "cache").glob("*"))  # no half-written library left


def test_bad_mode_is_a_clear_error(fresh) -> None:
    fresh.setenv(_cpukernel.ENV, "yes")
    with pytest.raises(ValueError, match="'auto'.*'0'.*'1'"):
        _cpukernel.status()


def test_cache_is_reused(fresh, tmp_path) -> None:
    fresh.setenv(_cpukernel.ENV, "auto")
    first = _cpukernel.status()
    if not first.available:
        pytest.skip(f"compiled CPU kernel unavailable here: {first.reason}")
    libs = list((tmp_path / "cache").glob("cpukernel-*.so"))
    assert len(libs) == 1 and str(libs[0]) == first.reason
    stamp = libs[0].stat().st_mtime_ns
    _cpukernel.reset()
    assert _cpukernel.status().reason == first.reason
    assert libs[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
    sha = libs[0].with_name(libs[0].name + ".sha256")
    assert sorted((tmp_path / "cache").glob("*")) == [libs[0], sha]  # no temporary files left
    assert sha.read_text() == _cpukernel._digest(libs[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threads", [1, 2])
def test_norms_are_float64_exact(kernel, dtype, threads) -> None:
    if dtype not in kernel.dtypes:
        pytest.skip(f"no compiled {dtype} path on this CPU")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(1)
        grads = [torch.randn(n, generator=gen).to(dtype) for n in (1, 15, 16, 17, 1025, 300_001)]
        grads.append(_specials(dtype))
        for p in (2.0, 1.0, math.inf):
            got = _cpukernel.foreach_norm(grads, p)
            want = torch.stack([torch.linalg.vector_norm(g.double(), p) for g in grads])
            assert got is not None and got.dtype == torch.float64
            if p == math.inf:
                assert torch.equal(got, want)  # a max is exact
            else:
                torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_norms_of_extreme_values_stay_finite(kernel, dtype) -> None:
    """Squares of the largest and smallest values neither overflow nor underflow in float64."""
    if dtype not in kernel.dtypes:
        pytest.skip(f"no compiled {dtype} path on this CPU")
    info = torch.finfo(dtype)
    big = torch.full((1000,), info.max, dtype=dtype)
    tiny = torch.full((1000,), info.smallest_normal / 8, dtype=dtype)  # subnormal
    got = _cpukernel.foreach_norm([big, tiny], 2.0)
    want = [float(info.max) * math.sqrt(1000), float(tiny[0]) * math.sqrt(1000)]
    assert got is not None
    assert got.tolist() == pytest.approx(want, rel=1e-15)


@pytest.mark.parametrize("p", [2.0, 1.0, math.inf])
def test_norms_of_non_finite_tensors_are_torchs(kernel, p) -> None:
    g = [torch.ones(300_000), torch.ones(5), torch.ones(7), torch.ones(9)]
    g[0][123_456] = float("inf")
    g[1][0] = float("nan")
    g[2][1], g[2][2] = float("inf"), float("nan")
    got = _cpukernel.foreach_norm(g, p)
    want = torch.stack([torch.linalg.vector_norm(t.double(), p) for t in g])
    assert got is not None
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    assert got[3].item() == want[3].item()


def test_norms_not_compiled_return_none(kernel) -> None:
    x = torch.randn(10, 10)
    assert _cpukernel.foreach_norm([x.t()], 2.0) is None  # not contiguous
    assert _cpukernel.foreach_norm([x], 3.0) is None  # p without a compiled path
    assert _cpukernel.foreach_norm([x.double()], 2.0) is None
    assert _cpukernel.foreach_norm([], 2.0) is None
    with _cpukernel.torch_kernel():
        assert _cpukernel.foreach_norm([x], 2.0) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_foreach_mul_is_torchs_bit_for_bit(kernel, dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    for factor in FACTORS:
        grads = [torch.randn(n, generator=gen).mul_(50).to(dtype) for n in (3, 1000, 200_003)]
        grads.append(_specials(dtype))
        a = [g.clone() for g in grads]
        b = [g.clone() for g in grads]
        torch._foreach_mul_(a, torch.tensor(factor))
        _cpukernel.foreach_mul_(b, torch.tensor(factor))
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x.view(INT[dtype]), y.view(INT[dtype])), factor


def test_channels_last_gradients_take_the_compiled_path(kernel) -> None:
    conv = torch.randn(8, 3, 5, 5).to(memory_format=torch.channels_last)
    conv3d = torch.randn(4, 2, 3, 3, 3).to(memory_format=torch.channels_last_3d)
    assert not conv.is_contiguous() and not conv3d.is_contiguous()
    conv[1, 2, 3, 4] = float("nan")
    _assert_same([conv, conv3d], 0.25)
    got = _cpukernel.foreach_norm([conv3d], 2.0)
    assert got is not None  # not None: the compiled path took it
    torch.testing.assert_close(
        got[0], torch.linalg.vector_norm(conv3d.double()), rtol=1e-13, atol=0
    )
    with _cpukernel.torch_kernel():
        assert _cpukernel.foreach_norm([conv3d], 2.0) is None


def test_a_cache_writable_by_others_is_not_trusted(fresh, tmp_path) -> None:
    """A library in a group/world-writable cache could have been planted: rebuild elsewhere."""
    shared = tmp_path / "cache"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    fresh.setenv(_cpukernel.ENV, "auto")
    st_ = _cpukernel.status()
    if not st_.available:
        pytest.skip(f"compiled CPU kernel unavailable here: {st_.reason}")
    assert not st_.reason.startswith(str(shared))  # built in the private temp dir instead
    assert not list(shared.glob("*.so"))
    lib = Path(st_.reason)
    assert lib.parent == tmp_path / "tmp" / f"shardscale-{_cpukernel._uid()}"
    # a cached library that others can write is rebuilt (a new file replaces it), not loaded
    lib.chmod(0o666)
    inode = lib.stat().st_ino
    _cpukernel.reset()
    assert _cpukernel.status().reason == str(lib)
    assert lib.stat().st_ino != inode and not lib.stat().st_mode & 0o022
    # no private location at all: a clear error when the kernel is required
    lib.unlink()
    lib.parent.chmod(0o777)
    _cpukernel.reset()
    fresh.setenv(_cpukernel.ENV, "1")
    with pytest.raises(_cpukernel.CpuKernelError, match="no private cache directory"):
        _cpukernel.status()


def test_tensor_subclass_gradients_go_to_torch(kernel) -> None:
    """A wrapper subclass's data_ptr() is not its data (0 here): never handed to the kernel."""
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    results = []
    for mode in ("auto", "0"):
        os.environ[_cpukernel.ENV] = mode
        _cpukernel.reset()
        torch.manual_seed(0)
        w = torch.nn.Parameter(two_tensor.TwoTensor(torch.randn(4, 4), torch.randn(4, 4)))
        scaler = ShardedGradScaler(init_scale=8.0)
        scaler.scale((w * 2).sum()).backward()
        assert type(w.grad).__name__ == "TwoTensor"
        opt = torch.optim.SGD([w], lr=0.1)
        scaler.step(opt)
        scaler.update()
        results.append(w.detach().a.clone())
        assert _cpukernel.foreach_norm([w.grad], 2.0) is None
    os.environ[_cpukernel.ENV] = "auto"
    assert torch.equal(results[0], results[1])


def test_mixed_dtypes_duplicates_and_misaligned_tensors_match_torch(kernel) -> None:
    a = torch.randn(300_000)
    mixed = [torch.randn(1000), torch.randn(1000).to(torch.bfloat16), a, a]  # a listed twice
    buf = torch.zeros(4 * 1001, dtype=torch.uint8)
    odd = torch.frombuffer(buf.numpy(), dtype=torch.float32, count=1000, offset=2)  # misaligned
    odd.copy_(torch.randn(1000))
    for factor in (0.5, 3.0):
        _assert_same(mixed + [odd], factor)
        (x, _), (y, _) = _both([a, a], factor)  # the same memory twice: applied twice, in order
        assert torch.equal(x[0], y[0])
    got = _cpukernel.foreach_norm([a, a], 2.0)  # reading twice is fine
    assert got is not None and got[0].item() == got[1].item()
    assert _cpukernel.foreach_norm([torch.randn(10), torch.randn(10).double()], 2.0) is None


def test_foreach_mul_bumps_versions_like_torch(kernel) -> None:
    a, b = torch.randn(1000), torch.randn(1000)
    va, vb = a._version, b._version
    torch._foreach_mul_([a], torch.tensor(0.5))
    _cpukernel.foreach_mul_([b], torch.tensor(0.5))
    assert a._version - va == 1 and b._version - vb >= 1
    c = torch.randn(1000)  # the unscale kernel, like torch's amp kernel, leaves versions alone
    vc = c._version
    _cpukernel.foreach_unscale_([c], torch.zeros(()), torch.tensor(0.5))
    assert c._version == vc


@pytest.mark.parametrize("threads", [3, 7])
def test_norms_with_more_threads_than_cores_and_many_tensors(kernel, threads) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(3)
        sizes = [1] * 40 + [150_000, 3, 150_000, 7, 100_000] + [16] * 500
        grads = [torch.randn(n, generator=gen) for n in sizes]
        for p in (2.0, 1.0, math.inf):
            got = _cpukernel.foreach_norm(grads, p)
            want = torch.stack([torch.linalg.vector_norm(g.double(), p) for g in grads])
            assert got is not None
            torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
            assert torch.equal(got, _cpukernel.foreach_norm(grads, p))  # the same bits again
    finally:
        torch.set_num_threads(before)


def test_no_home_directory_falls_back_to_the_temp_dir(fresh, tmp_path) -> None:
    fresh.delenv(_cpukernel.CACHE_ENV)
    fresh.delenv("XDG_CACHE_HOME", raising=False)

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    fresh.setattr(Path, "home", staticmethod(no_home))
    fresh.setenv(_cpukernel.ENV, "auto")
    st_ = _cpukernel.status()
    if st_.available:
        assert Path(st_.reason).parent == tmp_path / "tmp" / f"shardscale-{_cpukernel._uid()}"
    assert "Could not determine" not in st_.reason


def test_a_symlink_in_the_shared_temp_dir_is_refused(kernel, fresh, tmp_path) -> None:
    (tmp_path / "cache").mkdir(mode=0o777)
    (tmp_path / "cache").chmod(0o777)  # the user's cache is unusable: only the temp dir is left
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "tmp" / f"shardscale-{_cpukernel._uid()}").symlink_to(target)
    fresh.setenv(_cpukernel.ENV, "1")
    with pytest.raises(_cpukernel.CpuKernelError, match="no private cache directory"):
        _cpukernel.status()
    assert not list(target.iterdir())


def test_small_tensors_beyond_the_cap_stay_with_torchs_kernel(kernel, monkeypatch) -> None:
    monkeypatch.setattr(_cpukernel, "_SMALL", 8192)
    monkeypatch.setattr(_cpukernel, "_SMALL_CAP", 2)
    small = [torch.randn(100) for _ in range(4)]
    big = torch.randn(10_000)
    grads = [small[0], big, small[1], small[2], small[3]]
    batch = _cpukernel._flat(grads, torch.float32, writes=True)
    assert batch.taken == [small[0], big, small[1]] and batch.rest == small[2:]
    assert list(batch.lens) == [100, 10_000, 100]
    assert list(batch.ptrs) == [t.data_ptr() for t in batch.taken]
    _assert_same(grads, 0.5)
    batch = _cpukernel._flat(grads, torch.float32, writes=False)
    assert len(batch.taken) == 5 and not batch.rest  # norms (reads) take every size


def _unscale_in_child(sizes: list[int]) -> None:
    grads = [torch.ones(n) for n in sizes]
    found = torch.zeros(())
    _cpukernel.foreach_unscale_(grads, found, torch.tensor(0.5))
    _cpukernel.foreach_norm(grads, 2.0)
    os._exit(0 if all(bool((g == 0.5).all()) for g in grads) else 3)


@pytest.mark.parametrize("sizes", [[20_000] * 10, [32_768] * 8], ids=["20000", "32768"])
def test_forked_child_with_only_small_tensors_does_not_hang(kernel, sizes) -> None:
    """GNU OpenMP cannot start a parallel region in a child forked after the parent used one;
    torch's per-tensor kernels never start one for tensors of up to its grain (32768 elements),
    so neither does the compiled kernel: a child stepping a model of such tensors must not
    hang (``nn.Linear(256, 128).weight`` has exactly 32768)."""
    import multiprocessing as mp

    torch.set_num_threads(max(2, torch.get_num_threads()))
    big = [torch.ones(1_000_000)]
    _cpukernel.foreach_unscale_(big, torch.zeros(()), torch.tensor(0.5))  # threads started
    child = mp.get_context("fork").Process(target=_unscale_in_child, args=(sizes,))
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung in the compiled kernel")
    assert child.exitcode == 0


def test_relative_and_home_cache_dirs_resolve(kernel, fresh, tmp_path, monkeypatch) -> None:
    fresh.setenv(_cpukernel.ENV, "1")
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    monkeypatch.chdir(work)
    fresh.setenv(_cpukernel.CACHE_ENV, ".")
    assert _cpukernel.status().reason == str(work / Path(_cpukernel.status().reason).name)
    _cpukernel.reset()
    fresh.setenv("HOME", str(work))
    fresh.setenv(_cpukernel.CACHE_ENV, "~/kcache")
    assert Path(_cpukernel.status().reason).parent == work / "kcache"
    _cpukernel.reset()
    fresh.delenv(_cpukernel.CACHE_ENV)
    fresh.setenv("XDG_CACHE_HOME", "relative")  # ignored (XDG spec): ~/.cache instead
    assert Path(_cpukernel.status().reason).parent == work / ".cache" / "shardscale"


def test_a_truncated_cached_library_is_rebuilt(kernel, fresh, tmp_path) -> None:
    fresh.setenv(_cpukernel.ENV, "1")
    lib = Path(_cpukernel.status().reason)
    whole = lib.read_bytes()
    for cut in (0, 2000, len(whole) // 2):  # dlopen of a cut ELF file can die of SIGBUS
        # a new file, not the loaded one truncated in place (that would SIGBUS this process)
        lib.unlink()
        lib.write_bytes(whole[:cut])
        _cpukernel.reset()
        assert _cpukernel.status().reason == str(lib)
        assert lib.stat().st_size > cut and _cpukernel.status().available  # rebuilt


def test_a_compiler_that_writes_nothing_is_not_cached(fresh, tmp_path) -> None:
    fake = _fake_cc(tmp_path / "truecc", "exit 0")
    fresh.setenv("CC", str(fake))
    fresh.setenv(_cpukernel.ENV, "auto")
    st_ = _cpukernel.status()
    assert not st_.available and "wrote nothing" in st_.reason
    assert not list((tmp_path / "cache").glob("*.so"))


def test_a_cache_where_libraries_cannot_load_is_passed_over(kernel, fresh, tmp_path) -> None:
    """As on a noexec mount: the library is built and installed where it does load."""
    real = ctypes.CDLL

    def cdll(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path / "cache")):
            raise OSError("failed to map segment from shared object")
        return real(path, *args, **kwargs)

    fresh.setattr(_cpukernel.ctypes, "CDLL", cdll)
    fresh.setenv(_cpukernel.ENV, "auto")
    st_ = _cpukernel.status()
    assert st_.available
    assert Path(st_.reason).parent == tmp_path / "tmp" / f"shardscale-{_cpukernel._uid()}"
    builds = []
    fresh.setattr(_cpukernel, "_compile", lambda *a: builds.append(a))
    _cpukernel.reset()
    assert _cpukernel.status().reason == st_.reason and not builds  # found, not rebuilt


def test_overlapping_views_are_multiplied_twice_like_torch(kernel) -> None:
    torch.set_num_threads(max(2, torch.get_num_threads()))
    for _ in range(5):
        a = torch.randn(200_001)
        _assert_same([a[0:200_000], a[1:200_001]], 0.5)
    # [0, 400) holds [40, 80); [400, 440) only touches it; [1000, 1020) is apart
    assert _cpukernel._overlapping([0, 400, 40, 1000], [100, 10, 10, 5], 4) == {0, 2}


def test_non_plain_scale_or_flag_tensors_go_to_torch(kernel) -> None:
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    inv = two_tensor.TwoTensor(torch.tensor(0.5), torch.tensor(0.5))  # data_ptr() == 0
    assert inv.data_ptr() == 0
    a, b = torch.ones(100_000), torch.ones(100_000)
    torch._amp_foreach_non_finite_check_and_unscale_([a], torch.zeros(()), inv)
    _cpukernel.foreach_unscale_([b], torch.zeros(()), inv)
    assert torch.equal(a, b)
    found = two_tensor.TwoTensor(torch.zeros(()), torch.zeros(()))
    b[7] = float("inf")
    _cpukernel.foreach_unscale_([b], found, torch.tensor(0.5))  # torch's kernel, no crash
    assert found.a.item() == 1.0


def test_explicit_home_cache_without_a_home_uses_the_temp_dir(kernel, fresh, tmp_path) -> None:
    def no_home(self):
        raise RuntimeError("Could not determine home directory.")

    fresh.setattr(Path, "expanduser", no_home)
    fresh.setenv(_cpukernel.CACHE_ENV, "~/kc")
    fresh.setenv(_cpukernel.ENV, "1")
    st_ = _cpukernel.status()
    assert Path(st_.reason).parent == tmp_path / "tmp" / f"shardscale-{_cpukernel._uid()}"


def test_unsafe_math_in_cc_does_not_set_flush_to_zero(kernel, tmp_path) -> None:
    """crtfastmath.o (linked for -ffast-math/-Ofast/-funsafe-math-optimizations) would set
    flush-to-zero for the whole process when the library loads."""
    import subprocess
    import sys

    cc = shutil.which("gcc")
    if cc is None:
        pytest.skip("no gcc")
    script = (
        "import torch; from shardscale import _cpukernel as k; "
        "assert k.status().available, k.status().reason; "
        "print((torch.tensor([1e-40]) * torch.tensor([1.0])).item())"
    )
    for flags in ("-funsafe-math-optimizations", "-ffast-math", "-Ofast"):
        env = {
            **os.environ,
            "CC": f"{cc} {flags}",
            _cpukernel.CACHE_ENV: str(tmp_path / flags),
            _cpukernel.ENV: "1",
        }
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        assert float(out.stdout) > 0, flags  # the denormal survived


def test_a_hung_compiler_is_killed_with_its_children(fresh, tmp_path) -> None:
    marker = "41.2345"
    sleep = shutil.which("sleep")
    if sleep is None:
        pytest.skip("no sleep command")
    slow = _fake_cc(tmp_path / "slowcc", f"{sleep} {marker} &\nwait")
    fresh.setenv("CC", str(slow))
    fresh.setattr(_cpukernel, "_BUILD_TIMEOUT_S", 1)
    fresh.setenv(_cpukernel.ENV, "auto")
    st_ = _cpukernel.status()
    assert not st_.available and "timed out" in st_.reason

    def alive() -> list[str]:
        found = []
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if f"sleep {marker}" in cmd:
                found.append(cmd)
        return found

    if not Path("/proc").exists():
        pytest.skip("no /proc")
    import time

    deadline = time.monotonic() + 5
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive()


def _call_kernel(views: list[torch.Tensor], inv: float, found: torch.Tensor) -> int:
    fns = _cpukernel._load()[1]
    ptrs = array("q", [v.data_ptr() for v in views])
    lens = array("q", [v.numel() for v in views])
    factor = torch.tensor(inv)
    return fns.unscale(
        ptrs.buffer_info()[0], lens.buffer_info()[0], len(views), 0,
        factor.data_ptr(), found.data_ptr(), 2,
    )  # fmt: skip


def test_the_kernel_refuses_overlapping_memory_before_writing(kernel) -> None:
    """Threads writing shared memory would race: the C code checks the ranges first and writes
    nothing (not even found_inf) when two overlap; touching or disjoint ranges are fine."""
    a = torch.full((100_000,), 4.0)
    a[70_000] = float("inf")
    found = torch.zeros(())
    assert _call_kernel([a[50_000:], a[:60_000]], 0.5, found) == 1
    assert found.item() == 0.0 and torch.equal(a[:70_000], torch.full((70_000,), 4.0))
    assert _call_kernel([a[50_000:], a[:60_000]], 1.0, found) == 0  # factor 1 writes nothing
    assert found.item() == 1.0
    assert _call_kernel([a[50_000:], a[:50_000]], 0.5, found) == 0  # touching, not overlapping
    assert torch.equal(a[:70_000], torch.full((70_000,), 2.0))


def test_a_refused_batch_goes_to_torchs_kernel(kernel, monkeypatch) -> None:
    """-1 (no memory for the overlap check): nothing was written, torch's kernel does it all."""
    status, fns, codes = _cpukernel._load()
    calls = []

    def refuse(*args: object) -> int:
        calls.append(args)
        return -1

    fake = _cpukernel._Fns(refuse, fns.norms, refuse)
    monkeypatch.setattr(_cpukernel, "_loaded", (status, fake, codes))
    grads = [torch.randn(50_000) * 8, torch.randn(100)]
    grads[0][3] = float("inf")
    _assert_same(grads, 0.5)
    assert len(calls) == 1


def test_a_gradient_listed_twice_is_detected_by_the_kernel_and_multiplied_twice(kernel) -> None:
    """The same memory twice in one call (as torch's foreach kernel, which multiplies it twice):
    the kernel refuses the batch, both go to torch's kernel, the rest to the kernel."""
    g, other = torch.randn(40_000), torch.randn(40_000)
    g2, other2 = g.clone(), other.clone()
    batch = _cpukernel._flat([g, other, g], torch.float32, writes=True)
    assert len(batch.taken) == 3
    _cpukernel.unscale_batch_(batch, torch.zeros(()), torch.tensor(0.25))
    assert batch.taken == [other] and batch.rest == [g, g]
    torch._amp_foreach_non_finite_check_and_unscale_(
        [g2, other2, g2], torch.zeros(()), torch.tensor(0.25)
    )
    assert torch.equal(g, g2) and torch.equal(other, other2)


def test_addresses_are_read_after_user_grad_getters_ran(kernel) -> None:
    """A ``.grad`` getter of a parameter subclass runs user code during bucketing; if it replaces
    the storage of a gradient gathered before, the kernel must see the new storage (reading the
    old, freed one would leave the live gradient scaled and write freed memory)."""
    n = 1 << 16
    p1 = torch.nn.Parameter(torch.zeros(n))
    p1.grad = torch.full((n,), 1024.0)

    class Sneaky(torch.nn.Parameter):
        @property
        def grad(self):  # type: ignore[override]
            p1.grad.set_(torch.full((n,), 1024.0))  # storage replaced, the old one freed
            return torch.nn.Parameter.grad.__get__(self)

        @grad.setter
        def grad(self, value):  # type: ignore[override]
            torch.nn.Parameter.grad.__set__(self, value)

    p2 = Sneaky(torch.zeros(4))
    p2.grad = torch.ones(4)
    scaler = ShardedGradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))
    scaler.unscale_(torch.optim.SGD([p1, p2], lr=0.1))
    assert torch.equal(p1.grad, torch.ones(n))


@pytest.fixture(params=["avx512", "other"])
def loops(request, kernel) -> Iterator[str]:
    """Each family of the kernel's float16/bfloat16 write loops this CPU can run: the AVX-512
    intrinsics, and the others (float16's AVX2/F16C loop, bfloat16's compiler-vectorised loop in
    the clone this CPU picks; the only ones on CPUs without AVX-512), turned on here by switching
    the AVX-512 ones off."""
    avx512 = _cpukernel._load()[1].avx512
    if request.param == "avx512" and not avx512(1):
        pytest.skip("this CPU has no AVX-512F/BW")
    avx512(1 if request.param == "avx512" else 0)
    assert avx512(-1) == (request.param == "avx512")
    try:
        yield request.param
    finally:
        avx512(1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threads", [1, 2])
def test_every_16_bit_pattern_matches_torch(loops, dtype, threads) -> None:
    """All 65,536 encodings (inf and NaN among them) at several factors, at an even and an odd
    element offset and with a tail that is not a whole vector: torch's bits on every non-NaN
    result, NaN where torch has NaN, the same found_inf."""
    if dtype not in _cpukernel.status().dtypes:
        pytest.skip(f"no compiled {dtype} path on this CPU")
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = every[torch.isfinite(every.float())]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for inv in FACTORS + [2.0**-24, 65504.0, 2.0**100]:
            # 196,601 elements: over SS_PARALLEL_MIN, so threads=2 splits the call in two
            _assert_same([every.clone(), every.clone(), every[1:].clone()[:-7]], inv)
            _assert_same([finite.clone(), finite[1:].clone()], inv)  # found_inf stays 0
            for bad in (float("inf"), float("-inf"), float("nan")):  # found alone
                one = finite.clone()
                one[12_345] = bad
                _assert_same([one], inv)
            base = every.clone()
            _assert_same([base[1:40_001]], inv)  # odd address: unaligned vector loads
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_nan_factor_gives_nan_whatever_its_payload(loops, dtype) -> None:
    """A NaN multiplier (a clip coefficient from a NaN norm, or a caller's) makes every element
    NaN, as torch's kernels do, whatever the NaN's payload bits (found by the session-5 review:
    the bf16 AVX-512 loop's integer rounding carried 0x7fffffff's payload into the sign, writing
    -0.0)."""
    if dtype not in _cpukernel.status().dtypes:
        pytest.skip(f"no compiled {dtype} path on this CPU")
    for bits in (0x7FFFFFFF, 0xFFFF8001 - 2**32, 0x7FC00000, 0x7FC08001, 0xFFC00000 - 2**32):
        factor = torch.tensor(bits, dtype=torch.int32).view(torch.float32)
        grads = [torch.randn(1000).to(dtype), torch.ones(77, dtype=dtype)]
        found = torch.zeros(())
        _cpukernel.foreach_unscale_(grads, found, factor)
        assert all(bool(g.float().isnan().all()) for g in grads), hex(bits)
        assert found.item() == 0.0  # the gradients themselves were finite
        muls = [torch.ones(1000, dtype=dtype)]
        _cpukernel.foreach_mul_(muls, factor)
        assert bool(muls[0].float().isnan().all()), hex(bits)


def test_a_build_is_logged_and_a_cached_load_is_not(fresh, caplog) -> None:
    """Compiling says so at INFO on the shardscale logger (the pause has a name); loading the
    cached library logs nothing."""
    import logging

    with caplog.at_level(logging.INFO, logger="shardscale"):
        if not _cpukernel.status().available:
            pytest.skip("compiled CPU kernel unavailable here")
        assert "compiling _cpukernel.c into" in caplog.text
        caplog.clear()
        _cpukernel.reset()
        assert _cpukernel.status().available
        assert "compiling" not in caplog.text
