"""``benchmarks/bench.py``: a tiny ``--quick`` run of the script (imported by path, as
test_stress.py imports benchmarks/stress.py), its counted columns, its argument errors and its
helpers. No timing is asserted: only that every row is there and the counts are as expected."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import sys
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench.py"
_spec = importlib.util.spec_from_file_location("shardscale_bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["shardscale_bench"] = bench
_spec.loader.exec_module(bench)

SCALERS = ("shardscale", "torch GradScaler", "torch ShardedGradScaler")
DTYPES = ("fp32", "fp16", "bf16")


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[dict]]:
    """One ``--quick`` run at 50k elements, 1 round, 4 counted iterations: the printed rows by
    (section, contender, dtype) and the ``--json`` rows."""
    path = tmp_path_factory.mktemp("bench") / "rows.json"
    out = io.StringIO()
    argv = ["--quick", "--sizes", "50k", "--rounds", "1", "--json", str(path)]
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setattr(bench, "COUNT_ITERS", 4)
        assert bench.main(argv) == 0
    printed = {}
    for line in out.getvalue().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] != "section":
            printed[(cells[0], cells[1], cells[3])] = cells
    return printed, json.loads(path.read_text())


def _expected_rows() -> list[tuple[str, str, str]]:
    rows = [
        ("counts", f"{s} [{k}, {p}, {w}]", "fp32")
        for w in ("1 process", "2 gloo ranks")
        for k in ("sgd", "adamw_fused")
        for p in ("scale+step+update", "scale+clip+step+update")
        for s in SCALERS
    ]
    for d in DTYPES:
        torch_name = "torch ShardedGradScaler" if d == "fp16" else "torch GradScaler"
        recipe = f"torch unscale_+clip_grad_norm_ ({torch_name})"
        rows += [("limit", "in-place multiply (read+write)", d)]
        rows += [("unscale", s, d) for s in (*SCALERS, "torch kernel alone (no scaler)")]
        kinds = ("sgd", "adamw_foreach", "adamw_fused")
        rows += [("cycle", f"{s} [{k}]", d) for k in kinds for s in SCALERS]
        rows += [("clip", f"shardscale clip_grad_norm_ [{k}]", d) for k in ("sgd", "adamw_fused")]
        rows += [("clip", f"{recipe} [{k}]", d) for k in ("sgd", "adamw_fused")]
        rows += [
            ("clip", f"{s} clip+step+update [adamw_fused]", d) for s in ("shardscale", "torch")
        ]
        rows += [("memory", f"shardscale {m}", d) for m in ("unscale_", "clip_grad_norm_")]
        rows += [("memory", f"{torch_name} unscale_", d), ("memory", recipe, d)]
    return rows


def test_quick_run_prints_every_row_once(quick) -> None:
    printed, rows = quick
    expected = _expected_rows()
    assert sorted(printed) == sorted(expected)
    assert sorted((r["section"], r["name"], r["dtype"]) for r in rows) == sorted(expected)
    for r in rows:  # every timed shardscale row ran (torch's may be n/a: fp16, fused on CPU)
        if r["section"] in ("unscale", "cycle", "clip") and r["name"].startswith("shardscale"):
            assert r["ms"] > 0 and r["x_limit"] > 0 and not r["notes"].startswith("n/a"), r
            assert r["met"] is None  # 50k elements: the timing targets do not bind


def test_quick_run_counts(quick) -> None:
    """Per steady-state iteration: shardscale reads the host once with a non-fused optimizer
    (the skip decision) and never with a fused one, on the plain and the clip path; no
    collective in one process, exactly one on two ranks. torch's GradScaler: the same reads,
    never a collective."""
    _, rows = quick
    counts = {r["name"]: r for r in rows if r["section"] == "counts"}
    for where, collectives in (("1 process", 0), ("2 gloo ranks", 1)):
        for kind, reads in (("sgd", 1), ("adamw_fused", 0)):
            for path in ("scale+step+update", "scale+clip+step+update"):
                ours = counts[f"shardscale [{kind}, {path}, {where}]"]
                assert ours["counts"]["host_reads"] == reads, ours
                assert ours["counts"]["collectives"] == collectives, ours
                assert ours["counts"]["optimizer_reads_total"] == 0, ours
                assert ours["met"] is True
                theirs = counts[f"torch GradScaler [{kind}, {path}, {where}]"]["counts"]
                assert (theirs["host_reads"], theirs["collectives"]) == (reads, 0)


def _memory(rows: list[dict], dtype: str, name: str) -> dict:
    (row,) = [
        r for r in rows if r["section"] == "memory" and r["dtype"] == dtype and r["name"] == name
    ]
    return row["counts"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_quick_run_unscale_allocates_no_gradient_sized_memory(quick, dtype: str) -> None:
    counts = _memory(quick[1], dtype, "shardscale unscale_")
    assert counts["largest_allocation"] <= 1024 < counts["largest_gradient"] / 16, counts


@pytest.mark.parametrize("dtype", DTYPES)
def test_quick_run_clip_allocates_at_most_a_bounded_scratch(quick, dtype: str) -> None:
    """fp16 norms are taken in fp32 piece by piece: at most 1 MiB of scratch, whatever the size
    of the gradients; fp32/bf16 ones allocate nothing gradient-sized."""
    counts = _memory(quick[1], dtype, "shardscale clip_grad_norm_")
    limit = (1 << 20) + 1024 if dtype == "fp16" else 1024
    assert counts["largest_allocation"] <= limit, counts


def test_bad_arguments_exit_2(capsys) -> None:
    for argv in (
        ["--dtypes", "fp8"],
        ["--dtypes", ","],
        ["--sizes", "ten"],
        ["--sizes", "0"],
        ["--rounds", "0"],
        ["--sections", "x"],
        ["--sections", "unscale,bogus"],
        ["--threads", "0"],
        ["--ranks", "3"],
        ["--device", "tpu"],
        ["--device", "meta"],
    ):
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        assert e.value.code == 2, argv
    assert "usage: benchmarks/bench.py" in capsys.readouterr().err


def test_gradient_shapes_follow_gpt2_small() -> None:
    shapes = bench.gradient_shapes(10_000_000)
    assert sum(torch.Size(s).numel() for s in shapes) == 10_000_000
    assert shapes[:4] == [(768,), (768,), (768, 2304), (2304,)]
    assert sum(torch.Size(s).numel() for s in bench.gpt2_small_shapes()) == 124_439_808
    for total in (1, 769, 1234, 124_439_809):
        assert sum(torch.Size(s).numel() for s in bench.gradient_shapes(total)) == total
    assert bench.gradient_shapes(769) == [(768,), (1,)]
    with pytest.raises(ValueError):
        bench.gradient_shapes(0)


def test_read_counter_sees_reads_and_puts_torch_optim_apart() -> None:
    t = torch.tensor(1.0)
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    opt = torch.optim.Adam([p], foreach=False)  # reads its CPU step counter
    with bench._ReadCounter() as counter:
        t.item()
        bool(t)
        t.tolist()
        opt.step()
    assert counter.reads == 3 and counter.optimizer >= 1


def test_paired_ratio_is_the_median_of_same_round_ratios() -> None:
    ours = bench.Contender("ours", lambda: None, times=[2.0, 10.0, 3.0])
    ref = bench.Contender("ref", lambda: None, times=[1.0, 10.0, 1.0])
    # per-round ratios 2, 1, 3 -> 2 (a ratio of medians would give 3.0 / 1.0 = 3)
    assert bench.paired_ratio(ours, ref) == 2.0
    assert bench.paired_ratio(ref, ref) == 1.0
    assert bench.paired_ratio(ours, bench.Contender("none", lambda: None)) is None


def test_the_profiler_chatter_is_held_back_and_other_stderr_passed_on(capfd) -> None:
    """The memory rows' profiler writes "USDT:... profiler_start/stop" lines to fd 2: held back;
    anything else written to fd 2 meanwhile comes out after the block."""
    with bench._without_profiler_chatter():
        os.write(2, b"USDT:2026 x SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a real warning\n")
    assert bench._largest_allocation(lambda: torch.zeros(1000), torch.device("cpu")) >= 4000
    err = capfd.readouterr().err
    assert "USDT" not in err and err.count("a real warning") == 1
