"""``shardscale train``: end-to-end runs through the console script (torch elastic launcher,
gloo ranks on CPU) and the parent-side validation of bad input.

The main run (FSDP2, fp16, 2 ranks) uses a small init scale and growth interval so that the scale
sequence is known by hand: no natural overflow at scale <= 2048, injected overflows (on rank 1
only) at steps 4 and 9, growth every 3 clean steps.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardscale.train import cli, config, data, loop

ENTRY = [
    shutil.which("shardscale") or sys.executable,
    *([] if shutil.which("shardscale") else ["-m", "shardscale"]),
]
STEPS = 12
MAIN = [
    "--steps",
    str(STEPS),
    "--batch-size",
    "32",
    "--init-scale",
    "1024",
    "--growth-interval",
    "3",
    "--inject-inf-step",
    "4",
    "--inject-inf-step",
    "9",
    "--ckpt-every",
    "6",
    "--log-every",
    "5",
    "--no-progress",
]
# hand-computed: grow x2 after 3 clean steps, halve on the injected overflows at steps 4 and 9
EXPECTED_SCALES = [1024, 1024, 1024, 2048, 1024, 1024, 1024, 2048, 2048, 1024, 1024, 1024]
FINAL_SCALE = 2048.0


def _train(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*ENTRY, "train", *args], capture_output=True, text=True, timeout=timeout)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def main_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp2") / "run"
    proc = _train(*MAIN, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.dist
def test_fsdp2_fp16_run_writes_metrics_plot_summary(main_run: Path) -> None:
    rows = _rows(main_run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(set(r) == {"step", "loss", "scale", "skipped", "ranks_skipped"} for r in rows)
    assert [r["scale"] for r in rows] == EXPECTED_SCALES
    assert [r["step"] for r in rows if r["skipped"]] == [4, 9]
    # the inf was put on rank 1 only; both ranks skipped (the scaler's all-reduce agreed)
    assert [r["ranks_skipped"] for r in rows] == [2 if r["step"] in (4, 9) else 0 for r in rows]
    assert all(r["scale"] > 0 and r["loss"] == r["loss"] for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert (main_run / "loss_scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((main_run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["parallel"] == "fsdp2"
    assert summary["skipped_steps"] == 2 and summary["backoffs"] == 2 and summary["growths"] == 3
    assert summary["final_scale"] == FINAL_SCALE
    assert summary["scaler_metrics"]["skipped_steps"] == 2
    assert summary["scaler_metrics"]["steps"] == STEPS
    assert 0.0 <= summary["test_accuracy"] <= 1.0 and summary["time_per_step"] > 0


@pytest.mark.dist
def test_checkpoint_holds_full_state_and_exact_scaler(main_run: Path) -> None:
    ckpts = sorted(p.name for p in (main_run / "checkpoints").iterdir())
    assert ckpts == ["step-000006.pt", "step-000012.pt"]  # no temporary file left behind
    ck = torch.load(main_run / "checkpoints" / "step-000006.pt", weights_only=True)
    assert ck["step"] == 6 and ck["format"] == "shardscale.train/1"
    # full (unsharded) tensors: fc1 is 256 x 64 although each rank held half of it
    assert ck["model"]["fc1.weight"].shape == (256, 64)
    assert ck["model"]["fc1.weight"].dtype == torch.float32
    assert set(ck["optim"]["state"]["fc1.weight"]) >= {"exp_avg", "exp_avg_sq", "step"}
    # after step 6: scale 1024 (backed off at 4), two clean steps since (5, 6)
    assert ck["scaler"]["scale"] == 1024.0 and ck["scaler"]["_growth_tracker"] == 2
    assert ck["scaler"]["_counters"]["skipped_steps"] == 1


@pytest.mark.dist
def test_resume_continues_with_saved_scale_and_tracker(main_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "resumed"
    proc = _train(
        *MAIN, "--resume", str(main_run / "checkpoints" / "step-000006.pt"), "--out", str(out)
    )
    assert proc.returncode == 0, proc.stderr
    resumed, full = _rows(out), _rows(main_run)[6:]
    assert [r["step"] for r in resumed] == list(range(7, STEPS + 1))
    # step 7 uses the saved scale and, thanks to the restored tracker (2), grows after it
    assert resumed[0]["scale"] == 1024.0 and resumed[1]["scale"] == 2048.0
    # the resumed run is the uninterrupted one, bit for bit (losses included)
    assert resumed == full
    summary = json.loads((out / "summary.json").read_text())
    assert summary["start_step"] == 6 and summary["scaler_state_restored"] is True
    assert summary["final_scale"] == FINAL_SCALE


def test_none_text_smoke(tmp_path: Path) -> None:
    text = tmp_path / "poem.txt"
    text.write_text("Ünïcode line, the quick brown fox jumps over the lazy dog.\n" * 12, "utf-8")
    out = tmp_path / "text"
    proc = _train(
        "--parallel",
        "none",
        "--text",
        str(text),
        "--seq-len",
        "16",
        "--hidden",
        "32",
        "--layers",
        "1",
        "--batch-size",
        "8",
        "--steps",
        "3",
        "--no-progress",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "text" and summary["world_size"] == 1
    assert summary["perplexity"] == pytest.approx(2.718281828 ** summary["test_loss"], rel=1e-6)
    assert len(_rows(out)) == 3 and "perplexity" in proc.stdout


@pytest.mark.dist
def test_ddp_collapse_is_one_line_exit_2(tmp_path: Path) -> None:
    """DDP smoke and the collapse path: overflows on rank 1 only, both ranks skip, the run stops
    after 2 skipped steps in a row with one line from the launcher and exit code 2."""
    out = tmp_path / "collapse"
    proc = _train(
        "--parallel",
        "ddp",
        "--steps",
        "8",
        "--batch-size",
        "32",
        "--init-scale",
        "1024",
        "--max-consecutive-skips",
        "2",
        "--inject-inf-step",
        "3",
        "--inject-inf-step",
        "4",
        "--no-progress",
        "--out",
        str(out),
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardscale train: error: loss scale collapsed")
    rows = _rows(out)  # the metrics up to the collapse and the plot are still written
    assert [r["skipped"] for r in rows] == [False, False, True, True]
    assert [r["ranks_skipped"] for r in rows] == [0, 0, 2, 2]
    assert [r["scale"] for r in rows] == [1024, 1024, 1024, 512]
    assert (out / "loss_scale.png").exists() and not (out / "checkpoints").exists()


def test_bad_input_console_script_one_line() -> None:
    proc = _train("--nproc", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "shardscale train: error: argument --nproc: must be >= 1, got 0"
    ]


def _bad_checkpoint(tmp_path: Path) -> str:
    path = tmp_path / "step-000003.pt"
    path.write_bytes(b"PK\x03\x04 not really a zip")
    return str(path)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--nproc", "0"], "--nproc: must be >= 1"),
        (["--parallel", "fsdp3"], "invalid choice: 'fsdp3'"),
        (["--precision", "fp8"], "invalid choice: 'fp8'"),
        (["--init-scale", "inf"], "--init-scale: must be a finite number > 0"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["--text", "/no/such/file.txt"], "--text /no/such/file.txt: no such file"),
        (["--parallel", "none", "--nproc", "2"], "--parallel none trains one process"),
        (["--batch-size", "33"], "--batch-size 33 does not split evenly over 2 ranks"),
        (["--inject-inf-step", "99", "--steps", "5"], "--inject-inf-step 99 is beyond --steps 5"),
        (["--resume", "/no/such/run"], "--resume /no/such/run: no such file or directory"),
        ("BAD_CKPT", "not a readable checkpoint"),
        ("EMPTY_RUN", "no checkpoints/step-N.pt"),
    ],
)
def test_bad_input_exit_2_one_line(
    args: list[str] | str, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if args == "BAD_CKPT":
        args = ["--resume", _bad_checkpoint(tmp_path)]
    elif args == "EMPTY_RUN":
        args = ["--resume", str(tmp_path)]
    assert cli.main([*args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardscale train: error: ") and needle in err[0]
    assert not (tmp_path / "out").exists()  # nothing written, nothing launched


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CUDA-less error")
def test_device_cuda_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--device", "cuda"]) == 2
    assert capsys.readouterr().err.strip() == (
        "shardscale train: error: --device cuda: CUDA is not available on this machine; "
        "use --device cpu."
    )


def test_incompatible_checkpoint_is_refused(
    main_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = str(main_run / "checkpoints" / "step-000006.pt")
    assert cli.main(["--resume", ckpt, "--hidden", "128", "--steps", "12"]) == 2
    assert "another model (hidden: saved 256, now 128)" in capsys.readouterr().err
    assert cli.main(["--resume", ckpt, "--steps", "6"]) == 2
    assert "raise --steps" in capsys.readouterr().err


def test_batches_split_the_global_batch_and_are_step_deterministic() -> None:
    cfg = config.validate(config.parse(["--batch-size", "8", "--out", "unused"]))
    ds = data.load(cfg)
    assert ds.train_x.shape == (1347, 64) and ds.test_x.shape == (450, 64)
    assert torch.bincount(ds.test_y).tolist() == [44, 46, 44, 46, 45, 46, 45, 45, 44, 45]
    parts = [data.Batches(ds, cfg, r, 2).get(7) for r in range(2)]
    whole = data.Batches(ds, cfg, 0, 1).get(7)
    assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])
    assert torch.equal(torch.cat([p[1] for p in parts]), whole[1])
    assert torch.equal(data.Batches(ds, cfg, 1, 2).get(7)[0], parts[1][0])  # pure in step
    assert not torch.equal(data.Batches(ds, cfg, 0, 1).get(8)[0], whole[0])


def test_digits_fast_path_matches_sklearn() -> None:
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    x, y = data.load_digits()
    x_ref, y_ref = sklearn_datasets.load_digits(return_X_y=True)
    assert (x == x_ref).all() and (y == y_ref).all()


def test_lr_schedule_warmup_and_cosine() -> None:
    cfg = config.validate(config.parse(["--steps", "100", "--lr", "1e-3", "--out", "unused"]))
    assert loop.lr_at(cfg, 1) == pytest.approx(2e-4)  # warm-up over 5 steps
    assert loop.lr_at(cfg, 5) == pytest.approx(1e-3)
    assert loop.lr_at(cfg, 100) == pytest.approx(1e-4)  # cosine down to 10%
