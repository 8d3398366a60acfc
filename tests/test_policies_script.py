"""``benchmarks/policies.py --quick``: every row is there and ``policy="headroom"`` leaves 2**0
at once without a skip (no timing asserted)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "policies.py"
_spec = importlib.util.spec_from_file_location("shardscale_policies", _PATH)
policies = importlib.util.module_from_spec(_spec)
sys.modules["shardscale_policies"] = policies
_spec.loader.exec_module(policies)


def test_quick_run(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    png = tmp_path / "policies.png"
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rows = policies.main(["--quick", "--plot", str(png)])
    assert [(r["scaler"], r["init_e"]) for r in rows] == [
        (s, e) for e in (0, 24) for s in policies.SCALERS
    ]
    assert out.getvalue().count("\n| digits |") == 6
    head = next(r for r in rows if r["scaler"] == "headroom" and r["init_e"] == 0)
    assert head["reach10"] == 2 and head["skips_1_20"] == 0
    torch_24 = next(r for r in rows if r["scaler"] == "torch gi2000" and r["init_e"] == 24)
    head_24 = next(r for r in rows if r["scaler"] == "headroom" and r["init_e"] == 24)
    assert head_24["skips_1_20"] <= torch_24["skips_1_20"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cost_mode_runs_every_contender_on_the_device_given() -> None:
    """``--cost`` (the mode ``benchmarks/gpu_check.py`` runs with ``--device cuda``): one row
    per optimizer, every contender timed (no timing asserted)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rows = policies.main(
            ["--cost", "--tasks", "digits", "--rounds", "1", "--per-round", "1", "--device", "cpu"]
        )
    assert [(r["task"], r["opt"], r["device"]) for r in rows] == [
        ("digits", "adamw", "cpu"), ("digits", "fused", "cpu")
    ]  # fmt: skip
    for r in rows:
        assert set(r["calls_ms"]) == {"torch", "headroom", "headroom/4", "torch.amp"}
        assert all(v > 0 for v in r["calls_ms"].values()) and r["step_ms"] > 0
    assert out.getvalue().count("\n| digits |") == 2
