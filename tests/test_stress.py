"""Short version of the randomized agreement stress test (``benchmarks/stress.py``).

2 gloo ranks, seeded: random policies, fp32/fp16/bf16 parameters split between a fused AdamW
and a plain SGD, gradient accumulation, per-rank random ``unscale_`` use and inf/NaN injected on
random ranks and parameters. Every step checks the skip decisions against the injected pattern,
the scale/trackers/counters against the policy oracle (``tests/_oracle.py``), and bitwise cross-rank
agreement of skip flags, scale and parameters (see the module docstring of the script).
The long version: ``python benchmarks/stress.py --steps 10000``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from _dist import run_ranks

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "stress.py"
_spec = importlib.util.spec_from_file_location("shardscale_stress", _PATH)
stress = importlib.util.module_from_spec(_spec)
sys.modules["shardscale_stress"] = stress
_spec.loader.exec_module(stress)

STEPS = 400
PER_RUN = 40


@pytest.mark.dist
def test_stress_short_two_ranks_agree_with_reference(tmp_path):
    results = run_ranks(stress.worker, tmp_path, 1, STEPS, PER_RUN)
    mine = [{k: v for k, v in r.items() if k != "unscale_calls"} for r in results]
    assert mine[0] == mine[1]  # same counts on both ranks (shared injection pattern)
    stats = results[0]
    assert stats["steps"] == STEPS and stats["runs"] == STEPS // PER_RUN
    # the sample exercised what it claims: skips on both optimizers, clean steps, every kind
    # of injection, growths and backoffs, per-rank unscale_ use
    assert 0 < stats["skipped_adamw"] < STEPS and 0 < stats["skipped_sgd"] < STEPS
    for kind in stress.KINDS:
        assert stats.get(f"inject_{kind}", 0) > 0, kind
    assert stats["final_backoffs"] > 0 and stats["final_growths"] > 0
    assert stats["unscale_calls"] > 0
