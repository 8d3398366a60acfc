"""The C++ gathering of CPU gradients (_gather.cpp) against the Python path it stands in for."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardscale import ShardedGradScaler, _cpukernel, _gather
from shardscale._grads import bucket_grads

CPU = torch.device("cpu")


@pytest.fixture
def gathered() -> Iterator[None]:
    """The C++ gathering in use (skipped where it cannot be built: no C++ compiler or headers)."""
    on, why = _gather.status()
    if not on:
        pytest.skip(f"C++ gathering unavailable: {why}")
    yield


def _python(opt: torch.optim.Optimizer) -> dict:
    with _gather.python_path():
        return bucket_grads(opt)


def _same(got: dict, want: dict) -> None:
    """The same buckets: devices, dtypes in the same order, the same tensors (identity) split
    the same way, the same addresses and element counts."""
    assert list(got) == list(want)
    for device in want:
        assert list(got[device]) == list(want[device])
        for dtype, w in want[device].items():
            g = got[device][dtype]
            assert [id(t) for t in g.taken] == [id(t) for t in w.taken]
            assert [id(t) for t in g.rest] == [id(t) for t in w.rest]
            assert list(g.ptrs) == list(w.ptrs) and list(g.lens) == list(w.lens)
            assert g._small_left == w._small_left and g.dtype == w.dtype == dtype


def _misaligned(n: int) -> torch.Tensor:
    buf = torch.zeros(4 * (n + 1), dtype=torch.uint8)
    return torch.frombuffer(buf.numpy(), dtype=torch.float32, count=n, offset=2)


def _grad(kind: str, dtype: torch.dtype) -> tuple[tuple[int, ...], torch.Tensor | None]:
    """A parameter shape and a gradient of one kind."""
    if kind == "none":
        return (3, 5), None
    if kind == "empty":
        return (0, 4), torch.zeros(0, 4, dtype=dtype)
    if kind == "small":
        return (7,), torch.randn(7).to(dtype)
    if kind == "big":
        return (9000,), torch.randn(9000).to(dtype)
    if kind == "transposed":
        return (6, 4), torch.randn(4, 6).to(dtype).t()
    if kind == "channels_last":
        t = torch.randn(2, 3, 4, 5).to(dtype).contiguous(memory_format=torch.channels_last)
        return (2, 3, 4, 5), t
    if kind == "channels_last_3d":
        t = torch.randn(2, 3, 2, 4, 5).to(dtype)
        return (2, 3, 2, 4, 5), t.contiguous(memory_format=torch.channels_last_3d)
    if kind == "strided_4d":  # 4-d, neither contiguous nor channels-last
        return (2, 3, 4, 5), torch.randn(2, 3, 5, 4).to(dtype).transpose(2, 3)
    if kind == "misaligned":
        return (10,), _misaligned(10)  # float32 at an address 2 bytes off
    raise AssertionError(kind)


KINDS = [
    "none",
    "empty",
    "small",
    "big",
    "transposed",
    "channels_last",
    "channels_last_3d",
    "strided_4d",
    "misaligned",
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _optimizer(specs: list[tuple[str, torch.dtype, int]]) -> torch.optim.Optimizer:
    """SGD over parameters with the given (kind, dtype, param group) gradients."""
    groups: dict[int, list[torch.nn.Parameter]] = {}
    for kind, dtype, group in specs:
        dtype = torch.float32 if kind == "misaligned" else dtype
        shape, grad = _grad(kind, dtype)
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = grad
        groups.setdefault(group, []).append(p)
    return torch.optim.SGD([{"params": ps} for _, ps in sorted(groups.items())], lr=0.1)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(KINDS), st.sampled_from(DTYPES), st.integers(0, 2)),
        min_size=1,
        max_size=12,
    ),
    st.integers(0, 3),
)
def test_the_buckets_are_the_python_paths(specs, cap) -> None:
    """Any mix of dtypes, param groups, missing/empty/small/strided/channels-last/misaligned
    gradients, and any small-tensor cap: the same buckets as the Python path."""
    if not _gather.status()[0]:
        pytest.skip("C++ gathering unavailable")
    opt = _optimizer(specs)
    before, _cpukernel._SMALL_CAP = _cpukernel._SMALL_CAP, cap
    try:
        got = _gather.gather(opt)
        assert got is not None  # all of these are the common case
        _same(got, _python(opt))
        _same(bucket_grads(opt), _python(opt))
    finally:
        _cpukernel._SMALL_CAP = before


class _MyParam(torch.nn.Parameter):
    pass


class _MyTensor(torch.Tensor):
    pass


def _uncommon(case: str) -> torch.optim.Optimizer:
    p, q = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    p.grad, q.grad = torch.ones(4), torch.ones(4)
    params: list = [p, q]
    if case == "duplicate":
        params = [p, q, p]
    elif case == "plain_tensor_param":
        t = torch.zeros(4, requires_grad=True)
        t.grad = torch.ones(4)
        params = [p, t]
    elif case == "param_subclass":
        s = _MyParam(torch.zeros(4))
        s.grad = torch.ones(4)
        params = [p, s]
    elif case == "grad_subclass":
        q.grad = torch.ones(4).as_subclass(_MyTensor)
    elif case == "sparse":
        q.grad = torch.ones(4).to_sparse()
    elif case == "float64":
        q = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
        q.grad = torch.ones(4, dtype=torch.float64)
        params = [p, q]
    elif case == "meta":
        q = torch.nn.Parameter(torch.zeros(4, device="meta"))
        q.grad = torch.ones(4, device="meta")
        params = [p, q]
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize(
    "case",
    [
        "duplicate",
        "plain_tensor_param",
        "param_subclass",
        "grad_subclass",
        "sparse",
        "float64",
        "meta",
    ],
)
def test_anything_else_takes_the_python_path(gathered, case) -> None:
    """Not the common case: the C++ side answers None, and bucket_grads gives what the Python
    path gives (or raises what it raises)."""
    opt = _uncommon(case)
    assert _gather.gather(opt) is None
    try:
        want = _python(opt)
    except (TypeError, ValueError) as e:
        with pytest.raises(type(e), match=str(e)[:30]):
            bucket_grads(opt)
        return
    got = bucket_grads(opt)
    assert list(got) == list(want)
    for device in want:
        assert list(got[device]) == list(want[device])
        for dtype, w in want[device].items():
            assert _ids(got[device][dtype]) == _ids(w)


def _ids(bucket) -> list[tuple]:
    """The memory of each tensor (sparse values are new objects per call)."""
    tensors = bucket.tensors if hasattr(bucket, "tensors") else bucket
    return [(t.data_ptr(), t.shape, t.stride()) for t in tensors]


def test_container_subclasses_take_the_python_path(gathered) -> None:
    """A param group, param list or param_groups of a dict/list subclass is read through its
    own methods (the trial's find: the C API read past an overridden __getitem__/__iter__)."""

    class Group(dict):
        def __getitem__(self, key):  # hides the frozen parameters
            value = super().__getitem__(key)
            return [p for p in value if p.requires_grad] if key == "params" else value

    class Params(list):
        pass

    class Groups(list):
        pass

    for make in ("group", "params", "groups"):
        opt = _uncommon("plain")
        group = opt.param_groups[0]
        if make == "group":
            opt.param_groups[0] = Group(group)
            group["params"][1].requires_grad_(False)
        elif make == "params":
            group["params"] = Params(group["params"])
        else:
            opt.param_groups = Groups(opt.param_groups)
        assert _gather.gather(opt) is None, make
        _same(bucket_grads(opt), _python(opt))
    assert len(bucket_grads(opt)[CPU][torch.float32].taken) == 2  # all of them, via Python


def test_a_torch_function_mode_takes_the_python_path(gathered) -> None:
    """Under a __torch_function__ mode, `.grad` is read through Python (the mode sees it)."""
    seen = []

    class Watch(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    opt = _uncommon("plain")
    assert _gather.gather(opt) is not None
    with Watch():
        assert _gather.gather(opt) is None
        bucket_grads(opt)
    assert seen  # the mode saw the reads


def test_no_reference_is_leaked_or_dropped(gathered) -> None:
    """Every gradient's reference count is back where it was after many calls (the C++ side
    owns the references it hands back in the lists, and nothing else)."""
    opt = _optimizer([(k, d, 0) for k in KINDS for d in DTYPES])
    grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
    gc.collect()
    before = [sys.getrefcount(g) for g in grads]
    for _ in range(200):
        got = _gather.gather(opt)
        assert got is not None
    del got
    gc.collect()
    assert [sys.getrefcount(g) for g in grads] == before


def test_a_scaler_step_is_the_same_either_way(gathered) -> None:
    """The same training steps, bit for bit, with the C++ and the Python gathering."""
    results = []
    for python in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)).to(
            torch.bfloat16
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ShardedGradScaler("cpu", init_scale=2.0**10)
        for step in range(4):
            x = torch.randn(8, 16, dtype=torch.bfloat16)
            if step == 2:
                x[0, 0] = float("inf")  # a skipped step
            opt.zero_grad()
            scaler.scale(model(x).float().pow(2).mean()).backward()
            if python:
                with _gather.python_path():
                    scaler.step(opt)
            else:
                scaler.step(opt)
            scaler.update()
        results.append(([p.detach().clone() for p in model.parameters()], scaler.get_scale()))
    (a, sa), (b, sb) = results
    assert sa == sb == 2.0**9
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_it_can_be_turned_off_and_a_failed_build_falls_back(monkeypatch, tmp_path) -> None:
    """SHARDSCALE_CPU_GATHER=0, or no C++ compiler: the Python path, and training still runs."""
    try:
        monkeypatch.setenv(_gather.ENV, "0")
        _gather.reset()
        assert _gather.status() == (False, f"{_gather.ENV}=0")
        monkeypatch.setenv(_gather.ENV, "auto")
        monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
        monkeypatch.setenv(_cpukernel.CACHE_ENV, str(tmp_path / "cache"))
        _gather.reset()
        on, why = _gather.status()
        assert not on and "no-such-compiler" in why
        opt = _uncommon("plain")
        assert _gather.gather(opt) is None
        scaler = ShardedGradScaler("cpu", init_scale=4.0)
        scaler.scale(torch.ones(()))
        scaler.step(opt)
        scaler.update()
        assert opt.param_groups[0]["params"][0].grad.eq(0.25).all()
    finally:
        monkeypatch.undo()
        _gather.reset()
        _gather.status()
