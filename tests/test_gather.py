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


# ------------------------------------------------- the one-call unscale (_gather.unscale_)
#: gradient kinds the one-call unscale takes (plain, dense, aligned; or none/empty)
TAKEN = ["none", "empty", "small", "big", "channels_last", "channels_last_3d"]


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit except NaN payloads (torch's kernel, which the Python path uses for
    small tensors past the cap, may give another NaN): NaN at the same places."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])


def _grads_of(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]


def _both_ways(build, inv: torch.Tensor | None) -> tuple[dict, dict, list, list]:
    """unscale_grads_ on one copy (as it chooses), the Python path on another."""
    from shardscale._grads import unscale_and_check, unscale_grads_

    mine, theirs = build(), build()
    got = unscale_grads_(mine, inv)
    with _gather.python_path():
        want = unscale_and_check(bucket_grads(theirs), inv)
    return got, want, _grads_of(mine), _grads_of(theirs)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(TAKEN), st.integers(0, 2)), min_size=1, max_size=10),
    st.sampled_from(DTYPES),
    st.sampled_from([None, 1.0, 2.0**-8, 1.0 / 3.0, 2.0**100]),
    st.sampled_from(["finite", "inf", "nan"]),
    st.integers(0, 1000),
)
def test_the_one_call_unscale_is_the_python_paths(specs, dtype, inv, bad, seed) -> None:
    """One dtype, every gradient taken: the one-call unscale runs, and gives the Python path's
    gradients (bit for bit) and found_inf, for any factor (None: check only), with or without
    an inf/NaN."""
    if not _gather.status()[0]:
        pytest.skip("C++ gathering unavailable")

    def build() -> torch.optim.Optimizer:
        torch.manual_seed(seed)
        opt = _optimizer([(kind, dtype, group) for kind, group in specs])
        grads = [g for g in _grads_of(opt) if g.numel()]
        if bad != "finite" and grads:
            g = grads[seed % len(grads)]
            g[(0,) * g.dim()] = float(bad)  # (channels-last tensors have no flat view)
        return opt

    factor = None if inv is None else torch.tensor(inv)
    opt = build()
    flag = torch.zeros(())
    done = _gather.unscale_(opt, flag, torch.ones(()) if factor is None else factor)
    any_grad = any(g.numel() for g in _grads_of(opt))
    assert done is any_grad  # True: it ran; False: nothing to do
    got, want, a, b = _both_ways(build, factor)
    assert [d.type for d in got] == [d.type for d in want]
    for device in want:
        assert got[device].item() == want[device].item() == float(bad != "finite")
    assert len(a) == len(b) and all(_same_values(x, y) for x, y in zip(a, b, strict=True))


def _declined(case: str) -> torch.optim.Optimizer:
    """An optimizer the one-call unscale turns away (a case the gathering takes, or not)."""
    p, q = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(6, 4))
    p.grad, q.grad = torch.full((4,), 8.0), torch.full((6, 4), 8.0)
    if case == "mixed_dtypes":
        q.data, q.grad = q.data.bfloat16(), q.grad.bfloat16()
    elif case == "transposed":
        q.grad = torch.full((4, 6), 8.0).t()
    elif case == "misaligned":
        q.data, q.grad = torch.zeros(10), _misaligned(10).fill_(8.0)
    elif case == "shared_grad":  # two parameters, one gradient: the kernel refuses the overlap
        q.data, q.grad = torch.zeros(4), p.grad
    elif case in ("duplicate", "plain_tensor_param", "param_subclass", "grad_subclass"):
        return _uncommon(case)
    return torch.optim.SGD([p, q], lr=0.1)


DECLINED = [
    "mixed_dtypes",
    "transposed",
    "misaligned",
    "shared_grad",
    "duplicate",
    "plain_tensor_param",
    "param_subclass",
    "grad_subclass",
]


@pytest.mark.parametrize("case", DECLINED)
def test_the_one_call_unscale_declines_before_writing(gathered, case) -> None:
    """Not its case: None, nothing written (flag nor gradients), and unscale_grads_ gives the
    Python path's result."""
    opt = _declined(case)
    before = [g.clone() for g in _grads_of(opt)]
    flag = torch.zeros(())
    assert _gather.unscale_(opt, flag, torch.tensor(0.5)) is None
    assert flag.item() == 0.0
    assert all(torch.equal(x, y) for x, y in zip(_grads_of(opt), before, strict=True))
    got, want, a, b = _both_ways(lambda: _declined(case), torch.tensor(0.5))
    assert {d: f.item() for d, f in got.items()} == {d: f.item() for d, f in want.items()}
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("which", ["flag_float64", "flag_two_elements", "factor_meta"])
def test_the_one_call_unscale_declines_other_flags_and_factors(gathered, which) -> None:
    """A flag or factor it cannot address (not a plain one-element float32 CPU tensor): None."""
    opt = _declined("plain")
    flag, factor = torch.zeros(()), torch.tensor(0.5)
    if which == "flag_float64":
        flag = torch.zeros((), dtype=torch.float64)
    elif which == "flag_two_elements":
        flag = torch.zeros(2)
    else:
        factor = torch.tensor(0.5, device="meta")
    assert _gather.unscale_(opt, flag, factor) is None
    assert _grads_of(opt)[0].eq(8.0).all()


def test_the_one_call_unscale_steps_aside_for_modes_switches_and_torchs_kernel(gathered) -> None:
    """A __torch_function__ mode, python_path() and torch_kernel(): None, nothing written."""
    opt = _declined("plain")
    flag, half = torch.zeros(()), torch.tensor(0.5)
    with torch.overrides.TorchFunctionMode():
        assert _gather.unscale_(opt, flag, half) is None
    with _gather.python_path():
        assert _gather.unscale_(opt, flag, half) is None
    with _cpukernel.torch_kernel():
        assert _gather.unscale_(opt, flag, half) is None
    assert _grads_of(opt)[0].eq(8.0).all()
    assert _gather.unscale_(opt, flag, half) is True
    assert all(g.eq(4.0).all() for g in _grads_of(opt)) and flag.item() == 0.0


def test_gradients_fresh_from_backward_are_taken_and_subclasses_are_not(gathered) -> None:
    """Gradients the autograd engine made (no Python object yet) are taken without making
    one; a gradient subclass is known by its Python object even after the caller dropped it."""
    model = torch.nn.Linear(8, 3)
    model(torch.randn(5, 8)).sum().backward()
    want = [p.grad.clone() / 4 for p in model.parameters()]  # (this made Python objects)
    model.zero_grad()
    model(torch.randn(5, 8)).sum().backward()  # new gradients, made in C++
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert _gather.unscale_(opt, torch.zeros(()), torch.tensor(0.25)) is True
    for p in model.parameters():
        assert p.grad.isfinite().all()
    model.weight.grad = torch.ones(3, 8).as_subclass(_MyTensor)  # only the parameter holds it
    gc.collect()
    assert type(model.weight.grad) is _MyTensor
    assert _gather.unscale_(opt, torch.zeros(()), torch.tensor(0.25)) is None
    del want


def test_the_one_call_unscale_holds_no_reference(gathered) -> None:
    """Reference counts of parameters and gradients are unchanged after many calls."""
    opt = _optimizer([(k, torch.float32, i % 2) for i, k in enumerate(TAKEN)])
    params = [p for g in opt.param_groups for p in g["params"]]
    grads = _grads_of(opt)
    one = torch.ones(())
    gc.collect()
    before = [sys.getrefcount(t) for t in params + grads]
    for _ in range(200):
        assert _gather.unscale_(opt, torch.zeros(()), one) is True
    gc.collect()
    assert [sys.getrefcount(t) for t in params + grads] == before


def test_no_gradient_at_all_is_nothing_to_do(gathered) -> None:
    """No parameter has a gradient: False, and unscale_grads_ gives no flags (as the Python
    path: a rank holding no shard)."""
    from shardscale._grads import unscale_grads_

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    assert _gather.unscale_(opt, torch.zeros(()), torch.tensor(0.5)) is False
    assert unscale_grads_(opt, torch.tensor(0.5)) == {}


def test_shardscale_build_says_what_is_in_use(monkeypatch, capsys) -> None:
    """`shardscale build`: builds/loads both compiled parts and says so (exit 0); a part that
    is off is named with the reason (exit 1)."""
    from shardscale.cli import main as cli_main

    if not (_cpukernel.status().available and _gather.status()[0]):
        pytest.skip("compiled CPU parts unavailable here")
    assert cli_main(["build"]) == 0
    out = capsys.readouterr().out
    assert "CPU kernel: in use for float32" in out and "gathering: in use" in out
    try:
        monkeypatch.setenv(_gather.ENV, "0")
        _gather.reset()
        assert cli_main(["build"]) == 1
        assert f"gathering: not in use ({_gather.ENV}=0)" in capsys.readouterr().out
    finally:
        monkeypatch.undo()
        _gather.reset()
        _gather.status()
    assert cli_main(["build", "--what"]) == 2  # no options
    assert (
        cli_main(["build", "--help"]) == 0 and "usage: shardscale build" in capsys.readouterr().out
    )


def test_shardscale_build_reports_a_bad_kernel_setting(monkeypatch, capsys) -> None:
    """A bad SHARDSCALE_CPU_KERNEL value: one error line naming the fix, exit 1, no traceback."""
    from shardscale.cli import main as cli_main

    try:
        monkeypatch.setenv("SHARDSCALE_CPU_KERNEL", "bogus")
        _cpukernel.reset()
        _gather.reset()
        assert cli_main(["build"]) == 1
        err = capsys.readouterr().err
        assert "error: SHARDSCALE_CPU_KERNEL='bogus'" in err and "'auto'" in err
    finally:
        monkeypatch.undo()
        _cpukernel.reset()
        _gather.reset()
        _gather.status()
