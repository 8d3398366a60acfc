"""``shardscale bench``: a tiny --quick run of the real command, and its counted columns."""

from __future__ import annotations

import re

import pytest
import torch

from shardscale import bench
from shardscale.cli import main as cli_main


def test_gradient_shapes_follow_gpt2_small():
    shapes = bench.gradient_shapes(10_000_000)
    assert sum(torch.Size(s).numel() for s in shapes) == 10_000_000
    assert shapes[:4] == [(768,), (768,), (768, 2304), (2304,)]
    assert sum(torch.Size(s).numel() for s in bench.gpt2_small_shapes()) == 124_439_808
    assert sum(torch.Size(s).numel() for s in bench.gradient_shapes(1234)) == 1234
    with pytest.raises(ValueError):
        bench.gradient_shapes(0)


def test_bad_arguments_exit_2(capsys):
    for argv in (
        ["--dtypes", "fp8"],
        ["--sizes", "ten"],
        ["--rounds", "0"],
        ["--sections", "x"],
        ["--threads", "0"],
        ["--device", "tpu"],
        ["--device", "meta"],
    ):
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        assert e.value.code == 2
    capsys.readouterr()


def test_quick_run_prints_every_row_and_expected_counts(capsys):
    assert (
        cli_main(["bench", "--quick", "--sizes", "50k", "--rounds", "1", "--dtypes", "fp32"]) == 0
    )
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("| ") and "section" not in ln]
    rows = {tuple(c.strip() for c in ln.strip("|").split("|")[:2]): ln for ln in lines}
    sections = {k[0] for k in rows}
    assert sections == {"counts", "limit", "unscale", "cycle", "clip", "memory"}
    expected = [
        ("limit", "in-place multiply (read+write)"),
        ("unscale", "shardscale"),
        ("unscale", "torch GradScaler"),
        ("unscale", "torch ShardedGradScaler"),
        ("unscale", "per-row .item() loop (original)"),
        ("clip", "shardscale clip_grad_norm_ [sgd]"),
        ("clip", "torch unscale_+clip_grad_norm_ [sgd]"),
        ("clip", "shardscale clip+step+update [adamw_fused]"),
        ("memory", "shardscale clip_grad_norm_"),
    ] + [
        ("cycle", f"{n} [{k}]")
        for n in ("shardscale", "torch GradScaler")
        for k in ("sgd", "adamw", "adamw_fused")
    ]
    for key in expected:
        assert key in rows, key
    # timed shardscale rows carry a time in ms
    for key in expected[:2] + expected[5:6]:
        ms = rows[key].split("|")[5].strip()
        assert float(ms) > 0, key

    def counts(label):
        m = re.search(r"syncs=(\d+) collectives=(\d+)", rows[("counts", label)])
        assert m, rows[("counts", label)]
        return int(m.group(1)), int(m.group(2))

    # shardscale: exactly one collective per iteration; 1 host sync (the skip decision) for
    # non-fused optimizers, none with a fused one, on the plain and on the clipping path
    assert counts("shardscale [sgd, scale+step+update]") == (1, 1)
    assert counts("shardscale [sgd, clip path]") == (1, 1)
    assert counts("shardscale [adamw_fused, scale+step+update]") == (0, 1)
    assert counts("shardscale [adamw_fused, clip path]") == (0, 1)
    # torch's GradScaler: one sync per device in step, never a collective
    assert counts("torch GradScaler [sgd, scale+step+update]") == (1, 0)
    # no gradient-sized temporary: fp32 paths allocate a few bytes; fp16 clipping is bounded by
    # the fp32 conversion chunk (1 MiB), not by the gradients
    mem = {k[1] + " " + ln.split("|")[4].strip(): ln for k, ln in rows.items() if k[0] == "memory"}
    for key, ln in mem.items():
        size = int(re.search(r"largest allocation (\d+) B", ln).group(1))
        limit = bench._clip_chunk_bytes() + 1024 if "fp16" in key and "clip" in key else 1024
        assert size <= limit, (key, size)


def test_counting_helpers_see_reads_and_skip_cpu_only_paths():
    t = torch.tensor(1.0)
    with bench._ReadCounter() as reads:
        t.item()
        bool(t)
        t.tolist()
    assert reads.syncs == 3 and reads.cpu_only == 0


def test_paired_ratio_is_the_median_of_same_round_ratios():
    ours = bench.Contender("ours", lambda: None, times=[2.0, 10.0, 3.0])
    ref = bench.Contender("ref", lambda: None, times=[1.0, 10.0, 1.0])
    # per-round ratios 2, 1, 3 -> 2 (a ratio of medians would give 3.0 / 1.0 = 3)
    assert bench.paired_ratio(ours, ref) == 2.0
    assert bench.paired_ratio(ref, ref) == 1.0
    assert bench.paired_ratio(ours, bench.Contender("none", lambda: None)) is None


def test_the_profiler_chatter_is_held_back_and_other_stderr_passed_on(capfd) -> None:
    """The memory rows' profiler writes "USDT:... profiler_start/stop" lines to fd 2: held back;
    anything else written to fd 2 meanwhile comes out after the block."""
    import os

    with bench._without_profiler_chatter():
        os.write(2, b"USDT:2026 x SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a real warning\n")
    assert bench._largest_allocation(lambda: torch.zeros(1000), torch.device("cpu")) >= 4000
    err = capfd.readouterr().err
    assert "USDT" not in err and err.count("a real warning") == 1
