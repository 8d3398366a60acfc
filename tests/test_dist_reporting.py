"""Skip agreement, overflow reports, collapse and bf16 guard mode on 2 gloo ranks.

Both ranks train replicas of the same model on the same batches (no gradient all-reduce), so
their parameters stay bit-identical exactly when they take the same step decisions. Non-finite
values are injected on rank 1 only. All scenarios run in one launch of 2 processes.
"""

from __future__ import annotations

import logging

import pytest
import torch
from _dist import run_ranks

from shardscale import ScaleCollapseError, ShardedGradScaler

pytestmark = pytest.mark.dist

INF = float("inf")
NAN = float("nan")
FLAGS = [0, 1, 0, 0, 1, 0]  # steps where rank 1 injects an inf
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd_fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=0.01, fused=True),
}


class Net(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(3, 4, dtype=dtype), torch.nn.Tanh())
        self.decoder = torch.nn.Linear(4, 2, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def _model(dtype=torch.float32) -> Net:
    torch.manual_seed(0)
    return Net(dtype)


def _backward(scaler, model, i, bad=None, dtype=torch.float32):
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(i)).to(dtype)
    loss = model(x).float().pow(2).mean()
    (scaler.scale(loss) if scaler is not None else loss).backward()
    params = dict(model.named_parameters())
    for name, (index, value) in (bad or {}).items():
        params[name].grad.view(-1)[index] = value


def _checksum(model) -> list[list[float]]:
    return [p.detach().double().flatten().tolist() for p in model.parameters()]


def _entries(report):
    if report is None:
        return None
    return [(e.name, e.rank, e.n_inf, e.n_nan, e.numel) for e in report.entries]


def _skip_agreement(rank):
    out = {}
    for kind, make_opt in OPTIMIZERS.items():
        model = _model()
        opt = make_opt(model.parameters())
        scaler = ShardedGradScaler("cpu", init_scale=2.0**8, growth_interval=2)
        skipped = []
        for i, flag in enumerate(FLAGS):
            opt.zero_grad()
            bad = {"decoder.weight": (0, INF)} if flag and rank == 1 else None
            _backward(scaler, model, i, bad)
            scaler.step(opt)
            scaler.update()
            skipped.append(bool(scaler.last_step_skipped(opt)))
        out[kind] = (skipped, scaler.metrics(), _checksum(model))
    return out


def _overflow_reports(rank):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", param_names=model)
    out = {}
    # step 0: clean; step 1: 2 inf in decoder.weight on rank 1 only;
    # step 2: NaN in encoder.0.bias on rank 0 and inf in decoder.bias on rank 1
    plan = [
        {},
        {1: {"decoder.weight": [(0, INF), (5, -INF)]}},
        {0: {"encoder.0.bias": [(2, NAN)]}, 1: {"decoder.bias": [(1, INF)]}},
    ]
    for i, step in enumerate(plan):
        opt.zero_grad()
        _backward(scaler, model, i)
        params = dict(model.named_parameters())
        for name, writes in step.get(rank, {}).items():
            for index, value in writes:
                params[name].grad.view(-1)[index] = value
        scaler.step(opt)
        scaler.update()
        report = scaler.overflow_report(all_ranks=True)
        out[i] = (_entries(report), None if report is None else (report.step, report.scale))
    out["checksum"] = _checksum(model)
    return out


def _logged_reports(rank):
    """report_overflows=True: rank 0 logs the gathered report, once."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    log = logging.getLogger("shardscale")
    log.addHandler(handler)
    try:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
        scaler = ShardedGradScaler("cpu", param_names=model, report_overflows=True)
        for i, flag in enumerate([0, 1, 0]):
            opt.zero_grad()
            _backward(scaler, model, i, {"encoder.0.weight": (3, NAN)} if flag and rank else None)
            scaler.step(opt)
            scaler.update()
    finally:
        log.removeHandler(handler)
    return records


def _collapse(rank):
    """max_consecutive_skips=2 with inf on rank 1 only: both ranks raise at the same step."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", param_names=model, max_consecutive_skips=2)
    try:
        for i in range(4):
            opt.zero_grad()
            _backward(scaler, model, i, {"decoder.bias": (0, INF)} if rank == 1 else None)
            scaler.step(opt)
            scaler.update()
    except ScaleCollapseError as err:
        # every rank still reaches the next collective: no hang after a collapse
        torch.distributed.barrier()
        return (err.step, err.scale, _entries(err.report), str(err))
    return None


def _bf16(rank, guarded: bool):
    model = _model(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler.guard(param_names=model) if guarded else None
    skipped = []
    for i, flag in enumerate([0, 1, 0]):
        opt.zero_grad()
        bad = {"decoder.weight": (2, NAN)} if flag and rank == 1 else None
        _backward(scaler, model, i, bad, torch.bfloat16)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
            skipped.append(bool(scaler.last_step_skipped(opt)))
            if flag:
                report = _entries(scaler.overflow_report(all_ranks=True))
    out = {
        "checksum": _checksum(model),
        "nan": any(torch.isnan(p).any().item() for p in model.parameters()),
    }
    if scaler is not None:
        out.update(skipped=skipped, report=report, metrics=scaler.metrics())
    return out


def _all(rank, world_size):
    assert world_size == 2
    return {
        "skip": _skip_agreement(rank),
        "report": _overflow_reports(rank),
        "logged": _logged_reports(rank),
        "collapse": _collapse(rank),
        "bf16_plain": _bf16(rank, guarded=False),
        "bf16_guard": _bf16(rank, guarded=True),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_all, tmp_path_factory.mktemp("dist_reporting"))


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_skip_signal_agrees_across_ranks(results, kind):
    r0, r1 = (r["skip"][kind] for r in results)
    assert r0[0] == r1[0] == [bool(f) for f in FLAGS]  # rank 0 saw no inf, yet skipped
    assert r0[1] == r1[1]  # metrics: scale, trackers, counters
    assert r0[1]["skipped_steps"] == 2 and r0[1]["overflows"] == 2
    assert r0[2] == r1[2]  # parameters bit-identical on both ranks


def test_overflow_report_names_parameter_and_rank(results):
    r0, r1 = (r["report"] for r in results)
    assert r0[0] == r1[0] == (None, None)  # clean step
    assert r0[1] == r1[1] == ([("decoder.weight", 1, 2, 0, 8)], (1, 2.0**16))
    assert (
        r0[2]
        == r1[2]
        == (
            [("encoder.0.bias", 0, 0, 1, 4), ("decoder.bias", 1, 1, 0, 2)],
            (2, 2.0**15),
        )
    )
    assert r0["checksum"] == r1["checksum"]


def test_report_overflows_logs_the_gathered_report_once(results):
    l0, l1 = (r["logged"] for r in results)
    assert len(l0) == 1 and l1 == []
    assert l0[0].startswith("overflow at step 1 (loss scale 65536):")
    assert "rank 1: encoder.0.weight (torch.float32, 12 elements on cpu): 0 inf, 1 NaN" in l0[0]
    assert "rank 0" not in l0[0]


def test_collapse_raises_on_every_rank_at_the_same_step(results):
    c0, c1 = (r["collapse"] for r in results)
    assert c0[:2] == c1[:2] == (1, 2.0**15)
    # gathered over the ranks: rank 0's error names rank 1's parameter too
    assert c0[2] == c1[2] == [("decoder.bias", 1, 1, 0, 2)]
    assert "(rank 0," in c0[3] and "(rank 1," in c1[3]
    for msg in (c0[3], c1[3]):
        assert "decoder.bias on rank 1 (1 inf, 0 NaN)" in msg


def test_bf16_without_scaler_diverges_across_ranks(results):
    p0, p1 = (r["bf16_plain"] for r in results)
    assert not p0["nan"] and p1["nan"]
    assert p0["checksum"] != p1["checksum"]


def test_bf16_guard_keeps_ranks_identical_and_skips(results):
    g0, g1 = (r["bf16_guard"] for r in results)
    assert not g0["nan"] and not g1["nan"]
    assert g0["checksum"] == g1["checksum"]
    assert g0["skipped"] == g1["skipped"] == [False, True, False]
    assert g0["report"] == g1["report"] == [("decoder.weight", 1, 0, 1, 8)]
    assert g0["metrics"] == g1["metrics"]
    assert g0["metrics"]["scale"] == 1.0 and g0["metrics"]["skipped_steps"] == 1
    # both guarded replicas skipped step 1, which plain rank 0 took: they differ from it
    assert g0["checksum"] != results[0]["bf16_plain"]["checksum"]


def _fsdp2_no_reshard_names(rank: int, world_size: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    fully_shard(m[0])
    fully_shard(m)
    m.set_reshard_after_backward(False)  # the modules hold unsharded parameters at report time
    s = ShardedGradScaler("cpu", param_names=m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    s.scale((m(torch.randn(2, 4)) * float("inf")).sum()).backward()
    s.step(opt)
    s.update()
    return sorted(set(s.overflow_report(all_ranks=True).names))


@pytest.mark.dist
def test_fsdp2_names_without_resharding_after_backward(tmp_path):
    for names in run_ranks(_fsdp2_no_reshard_names, tmp_path):
        assert names == ["0.bias", "0.weight", "2.bias", "2.weight"]
