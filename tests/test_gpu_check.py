"""``benchmarks/gpu_check.py`` dry run on the CPU, so the GPU script (run only when a machine
with a GPU is lent) does not rot between such machines: its checks run with ``"cuda"`` replaced
by ``"cpu"`` and the CUDA-only calls stubbed. Correctness is asserted where the CPU run means
something (parity with torch, the policy against the oracle); the timing functions only have to
run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.fixture
def dry(monkeypatch: pytest.MonkeyPatch) -> dict:
    src = SCRIPT.read_text()
    src = src.replace('"cuda"', '"cpu"').replace(
        "ProfilerActivity.CPU, ProfilerActivity.CUDA", "ProfilerActivity.CPU"
    )
    src = src.replace('getattr(e, "device_time_total", 0)', 'getattr(e, "cpu_time_total", 0)')
    src = src.replace('if __name__ == "__main__":', "if False:")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    ns: dict = {"__name__": "gpu_check_dry", "__file__": str(SCRIPT)}
    exec(compile(src, str(SCRIPT), "exec"), ns)
    return ns


def test_gpu_check_runs_on_the_cpu(dry: dict) -> None:
    for fused in (False, True):
        for clip in (False, True):
            assert dry["parity_autocast"]("cpu", fused, clip, steps=2) < 1e-5
    assert dry["parity_fp16_params"]("cpu") < 2e-3
    assert dry["parity_mixed_devices"](steps=4) < 1e-6
    assert dry["policy_kernels_match_reference"](steps=20)
    for fused in (False, True):
        ok, detail = dry["collapse_raises_on_cuda"](fused)
        assert ok, detail
    ok, detail = dry["shared_memory_grad_refused_on_cuda"]()
    assert ok, detail
    for fused in (False, True):
        for clip in (False, True):
            ok, detail = dry["headroom_by_hand"]("cpu", fused, clip)
            assert ok, detail
    for fn in ("copy_vs_unscale", "kernel_bandwidth"):
        u, c = dry[fn](100_000, torch.float16, rounds=2)
        assert u > 0 and c > 0
