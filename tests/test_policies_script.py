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
