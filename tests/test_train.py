"""``shardscale train``: end-to-end runs through the console script (torch elastic launcher,
gloo ranks on CPU) and the parent-side validation of bad input.

The main run (FSDP2, fp16, 2 ranks) uses a small init scale and growth interval so that the scale
sequence is known by hand: no natural overflow at scale <= 2048, injected overflows (on rank 1
only) at steps 4 and 9, growth every 3 clean steps.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardscale import ShardedGradScaler
from shardscale.train import checkpoint, cli, config, data, loop, model, report

# the console script of the interpreter running the tests (not another one on PATH)
_SCRIPT = Path(sys.executable).parent / "shardscale"
ENTRY = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "shardscale"]
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
    assert ck["scaler_kind"] == "shardscale/fp16"
    assert ck["run"] == {
        "steps": STEPS,
        "lr": 2e-3,
        "weight_decay": 0.01,
        "batch_size": 32,
        "seed": 0,
        "clip_grad_norm": None,
        "policy": "torch",  # resolved: --policy not given, a fresh run
        "growth_interval": 3,
    }


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
    assert summary["run_changes"] == [] and "warning" not in proc.stderr
    # the new --out holds steps 7-12 only (1 skip); the counts are the scaler's, whole run
    assert sum(r["skipped"] for r in resumed) == 1
    assert (summary["skipped_steps"], summary["backoffs"], summary["growths"]) == (2, 2, 3)
    assert summary["skip_counts_steps"] == [1, STEPS]
    assert "skipped steps  2  (backoffs 2, growths 3; steps 1-12)" in proc.stdout
    assert "scaler state   restored\n" in proc.stdout


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
    assert "char transformer on poem.txt, single process, cpu, fp16" in proc.stdout


@pytest.mark.dist
def test_ddp_collapse_is_one_line_exit_2(tmp_path: Path) -> None:
    """DDP smoke and the collapse path: overflows on rank 1 only, both ranks skip, the run stops
    after 2 skipped steps in a row with one line from the launcher and exit code 2; the line
    names the step as metrics.jsonl and --inject-inf-step do (4, not the scaler's index 3)."""
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
    assert "at training step 4" in lines[0] and "step 3" not in lines[0]
    assert "fc1.weight" in lines[0]  # the parameter holding the inf
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


class _NotWeights:
    pass


def _pickled_object_checkpoint(tmp_path: Path) -> str:
    path = tmp_path / "step-000004.pt"  # torch's refusal text holds ANSI escape codes
    torch.save({"format": "shardscale.train/1", "obj": _NotWeights()}, path)
    return str(path)


UNREADABLE = (
    "not a readable shardscale checkpoint (corrupt, truncated, or not written by "
    "`shardscale train`)."
)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--nproc", "0"], "--nproc: must be >= 1"),
        (["--parallel", "fsdp3"], "invalid choice: 'fsdp3'"),
        (["--precision", "fp8"], "invalid choice: 'fp8'"),
        (["--init-scale", "inf"], "--init-scale: must be a finite number > 0"),
        (["--init-scale", "2**200"], "--init-scale 2**200: must lie in [2**-126, 2**127]"),
        (["--init-scale", "1e-40"], "--init-scale 1e-40: must lie in [2**-126, 2**127]"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["--text", "/no/such/file.txt"], "--text /no/such/file.txt: no such file"),
        (["--parallel", "none", "--nproc", "2"], "--parallel none trains one process"),
        (["--batch-size", "33"], "--batch-size 33 does not split evenly over 2 ranks"),
        (["--weight-decay", "nan"], "--weight-decay must be a finite number >= 0, got nan"),
        (["--weight-decay", "inf"], "--weight-decay must be a finite number >= 0, got inf"),
        (
            ["--parallel", "ddp", "--reduce-dtype", "bf16", "--device", "cpu"],
            "--parallel ddp --reduce-dtype bf16 needs CUDA/NCCL",
        ),
        (["--inject-inf-step", "99", "--steps", "5"], "--inject-inf-step 99 is beyond --steps 5"),
        (["--resume", "/no/such/run"], "--resume /no/such/run: no such file or directory"),
        ("BAD_CKPT", UNREADABLE),
        ("OBJECT_CKPT", UNREADABLE),
        ("EMPTY_RUN", "no checkpoints/step-N.pt"),
    ],
)
def test_bad_input_exit_2_one_line(
    args: list[str] | str, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if args == "BAD_CKPT":
        args = ["--resume", _bad_checkpoint(tmp_path)]
    elif args == "OBJECT_CKPT":
        args = ["--resume", _pickled_object_checkpoint(tmp_path)]
    elif args == "EMPTY_RUN":
        args = ["--resume", str(tmp_path)]
    assert cli.main([*args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardscale train: error: ") and needle in err[0]
    assert "\x1b" not in err[0]
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


def test_bad_scaler_state_is_refused_in_parent(
    main_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = torch.load(main_run / "checkpoints" / "step-000006.pt", weights_only=True)
    ck["scaler"]["scale"] = -1.0
    torch.save(ck, tmp_path / "step-000006.pt")
    assert cli.main(["--resume", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "its scaler state does not load (state_dict['scale'] must be > 0, got -1.0)." in err[0]
    )
    assert not (tmp_path / "o").exists()


def test_scaler_plan_across_scalers_and_precisions(main_run: Path) -> None:
    ck = torch.load(main_run / "checkpoints" / "step-000006.pt", weights_only=True)
    plan = checkpoint.scaler_plan
    assert plan(ck, "shardscale/fp16") == (True, "")
    assert plan(ck, "torch/fp16") == (True, "from --scaler shardscale")
    assert plan(ck, "shardscale/bf16") == (False, "checkpoint used --precision fp16")
    assert plan(ck, "torch/fp32") == (False, "checkpoint used --precision fp16")
    guard = {**ck, "scaler_kind": "shardscale/bf16", "scaler": {"scale": 1.0}}
    assert plan(guard, "shardscale/fp32") == (True, "")
    assert plan(guard, "torch/bf16") == (False, "--scaler torch is disabled with --precision bf16")
    assert plan(guard, "shardscale/fp16") == (False, "checkpoint used --precision bf16")
    off = {**ck, "scaler_kind": "torch/bf16", "scaler": {}}
    assert plan(off, "shardscale/bf16")[0] is False and "was disabled" in plan(off, "x/bf16")[1]
    # the states really load both ways: shardscale's into torch's, torch's into shardscale's
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=3)
    torch_scaler.load_state_dict(ck["scaler"])
    assert torch_scaler._init_scale == 1024.0 and torch_scaler._init_growth_tracker == 2
    ours = ShardedGradScaler("cpu", init_scale=8.0, growth_interval=3)
    ours.load_state_dict(torch_scaler.state_dict())
    m = ours.metrics()
    assert (m["scale"], m["growth_tracker"], m["skipped_steps"]) == (1024.0, 2, 0)


def test_run_changes_and_summary_table(main_run: Path) -> None:
    ck = torch.load(main_run / "checkpoints" / "step-000006.pt", weights_only=True)
    same = config.validate(config.parse([*MAIN, "--out", "unused"]))
    assert checkpoint.run_changes(ck, same) == []
    other = config.validate(config.parse([*MAIN, "--steps", "40", "--lr", "1e-3", "--out", "x"]))
    assert checkpoint.run_changes(ck, other) == [
        "--steps 40 (checkpoint's run: 12)",
        "--lr 0.001 (checkpoint's run: 0.002)",
    ]
    summary = json.loads((main_run / "summary.json").read_text())
    assert summary["skip_counts_steps"] == [1, STEPS] and summary["resumed_from"] is None
    summary.update(
        start_step=6,
        scaler_state_restored=False,
        scaler_state_note="checkpoint used --precision fp16",
        run_changes=["--steps 40 (checkpoint's run: 12)"],
        skip_counts_steps=[7, 40],
    )
    text = report.table(summary)
    assert "  scaler state   not restored: checkpoint used --precision fp16\n" in text
    assert "  not bit-exact  --steps 40 (checkpoint's run: 12)" in text
    assert "this run segment: steps 7-40)" in text
    assert text.rstrip().endswith("summary.json, checkpoints/step-000012.pt)")


def test_help_has_no_duplicate_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in out and "(default: [])" not in out
    assert "no progress bar --inject-inf-step" in out  # not "(default: True)"
    assert "local worker processes (default 2; 1 with --parallel none) --device" in out
    assert "(default: 400)" in out  # other defaults still shown


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


def test_restore_into_torch_scaler_in_process(main_run: Path) -> None:
    """checkpoint.restore without a launch (plain module): shardscale's state goes into
    torch.amp.GradScaler; a bf16 guard does not take the fp16 state and says why."""
    cfg = config.validate(config.parse(["--parallel", "none", "--out", "unused"]))
    ck = checkpoint.read(main_run / "checkpoints" / "step-000006.pt")
    net = model.build(cfg, data.load(cfg))
    opt = torch.optim.AdamW(net.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=3)
    assert checkpoint.restore(ck, net, opt, scaler, dataclasses.replace(cfg, scaler="torch")) == (
        6,
        True,
        "from --scaler shardscale",
    )
    assert scaler.get_scale() == 1024.0 and scaler._init_growth_tracker == 2
    assert torch.equal(net.fc1.weight, ck["model"]["fc1.weight"])
    assert opt.state_dict()["state"][0]["step"] == 5  # 6 steps, the 4th skipped
    guard = ShardedGradScaler.guard()
    assert checkpoint.restore(ck, net, opt, guard, dataclasses.replace(cfg, precision="bf16")) == (
        6,
        False,
        "checkpoint used --precision fp16",
    )
    assert guard.metrics()["steps"] == 0 and guard.get_scale() == 1.0


def test_skip_counts_of_torch_scaler_label_the_segment(tmp_path: Path) -> None:
    cfg = config.validate(config.parse(["--steps", "10", "--out", str(tmp_path)]))
    scaler = torch.amp.GradScaler("cpu")
    scales = [8.0, 4.0, 4.0, 8.0]  # steps 7-10: backoff after 7 (skipped), growth after 9
    writer = report.MetricsWriter(tmp_path)
    rows = [
        {"step": 7 + i, "loss": 1.0, "scale": sc, "skipped": i == 0, "ranks_skipped": 0}
        for i, sc in enumerate(scales)
    ]
    writer.write(rows)
    counts = loop._skip_counts(cfg, scaler, 6, 16.0)  # final scale 16: grew after step 10
    assert counts == {
        "skipped_steps": 1,
        "backoffs": 1,
        "growths": 2,
        "skip_counts_steps": [7, 10],
        "skip_counts_from": "metrics.jsonl",
    }
    earlier = [{**rows[0], "step": k, "skipped": k == 2, "scale": 8.0} for k in range(1, 7)]
    report.MetricsWriter(tmp_path).write(earlier + rows)  # the whole run: steps 1-10
    counts = loop._skip_counts(cfg, scaler, 6, 16.0)
    assert counts["skipped_steps"] == 2 and counts["skip_counts_steps"] == [1, 10]


def test_resume_with_other_steps_warns_in_one_line(
    main_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = str(main_run / "checkpoints" / "step-000006.pt")
    cfg = config.parse([*MAIN, "--steps", "20", "--resume", ckpt, "--out", str(tmp_path)])
    extra = cli._prepare(cfg)  # what cli.main does before launching
    assert extra[-4:] == ["--resume", ckpt, "--out", str(tmp_path)]
    assert capsys.readouterr().err.splitlines() == [
        f"shardscale train: warning: --resume {ckpt}: --steps 20 (checkpoint's run: 12): this "
        "is not the checkpoint's run continued (the LR warm-up and cosine span --steps); it "
        "will not match an uninterrupted run bit for bit."
    ]
    cli._prepare(config.parse([*MAIN, "--resume", ckpt, "--out", str(tmp_path)]))
    assert capsys.readouterr().err == ""  # same settings: the same run, continued


def test_a_new_history_moves_later_checkpoints_aside(tmp_path: Path) -> None:
    """Starting (or resuming) at step k in a run directory with a previous history's later
    checkpoints moves them aside, so `--resume <dir>` continues the new history, not the old."""
    ckdir = tmp_path / "checkpoints"
    ckdir.mkdir()
    for step in (10, 20, 30):
        (ckdir / f"step-{step:06d}.pt").write_bytes(b"x")
    assert checkpoint.resolve(tmp_path).name == "step-000030.pt"
    moved = checkpoint.supersede_after(tmp_path, 10)
    assert moved is not None and moved[1] == 2
    assert sorted(f.name for f in moved[0].iterdir()) == ["step-000020.pt", "step-000030.pt"]
    assert checkpoint.resolve(tmp_path).name == "step-000010.pt"
    assert checkpoint.supersede_after(tmp_path, 10) is None  # nothing later any more
    assert checkpoint.supersede_after(tmp_path / "fresh", 0) is None  # no checkpoints folder


def test_policy_headroom_reaches_the_scaler_and_the_plot(tmp_path: Path) -> None:
    out = tmp_path / "headroom"
    proc = _train(
        "--parallel", "none", "--policy", "headroom", "--init-scale", "1", "--hidden", "32",
        "--steps", "5", "--no-progress", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "growth_interval" not in proc.stderr  # not passed to a policy that has none
    rows = _rows(out)
    scales = [r["scale"] for r in rows]  # what loss_scale.png draws on its scale axis
    assert scales[0] == 1.0 and min(scales[1:]) >= 2.0**10  # measured: straight to the target
    assert not any(r["skipped"] for r in rows)
    assert (out / "loss_scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["policy"] == "headroom" and summary["scaler_metrics"]["growths"] >= 1
    bad = _train("--parallel", "none", "--policy", "headroom", "--scaler", "torch")
    assert bad.returncode == 2 and "--policy headroom needs --scaler shardscale" in bad.stderr
    bad = _train("--parallel", "none", "--policy", "headroom", "--precision", "bf16")
    assert bad.returncode == 2 and "--policy headroom needs --precision fp16" in bad.stderr


def test_a_resume_follows_the_checkpoints_policy_unless_told(tmp_path: Path) -> None:
    """Without --policy a resume continues the checkpoint's rule; --policy torch switches to
    torch's rule with this run's --growth-interval (torch's load_state_dict would take the
    state's): a run change of the summary and the warning line, and the scaler's own
    warning about the policy is not repeated."""
    first = tmp_path / "headroom"
    common = ("--parallel", "none", "--hidden", "32", "--no-progress", "--ckpt-every", "3")
    proc = _train(*common, "--policy", "headroom", "--steps", "3", "--out", str(first))
    assert proc.returncode == 0, proc.stderr
    ckpt = str(first / "checkpoints" / "step-000003.pt")
    same = tmp_path / "same"  # --growth-interval: unused by the headroom rule, not a change
    proc = _train(
        *common, "--steps", "5", "--resume", ckpt, "--out", str(same), "--growth-interval", "7"
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((same / "summary.json").read_text())
    assert summary["policy"] == "headroom"
    assert summary["run_changes"] == ["--steps 5 (checkpoint's run: 3)"]
    assert "UserWarning" not in proc.stderr
    switched = tmp_path / "switched"
    proc = _train(
        *common, "--steps", "6", "--resume", ckpt, "--out", str(switched),
        "--policy", "torch", "--growth-interval", "1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((switched / "summary.json").read_text())
    assert summary["policy"] == "torch"
    assert summary["run_changes"] == [
        "--steps 6 (checkpoint's run: 3)",
        "--policy torch (checkpoint's run: headroom)",  # the interval: the new rule's
    ]
    assert "--policy torch (checkpoint's run: headroom)" in proc.stderr
    assert "UserWarning" not in proc.stderr
    scales = [r["scale"] for r in _rows(switched)]
    assert all(b == 2 * a for a, b in zip(scales, scales[1:], strict=False))  # grows every step


def test_a_resume_keeps_the_checkpoints_growth_interval_unless_told(tmp_path: Path) -> None:
    """--growth-interval not given on a resume: the checkpoint's run's (torch's load_state_dict
    behaviour), no run change; given: this run's, a run change."""
    first = tmp_path / "gi2"
    common = ("--parallel", "none", "--hidden", "32", "--no-progress", "--ckpt-every", "2")
    proc = _train(*common, "--growth-interval", "2", "--steps", "2", "--out", str(first))
    assert proc.returncode == 0, proc.stderr
    ckpt = str(first / "checkpoints" / "step-000002.pt")
    for extra, changes, interval in (
        ((), [], 2),
        (("--growth-interval", "3"), ["--growth-interval 3 (checkpoint's run: 2)"], 3),
    ):
        out = tmp_path / f"resumed{interval}"
        proc = _train(*common, "--steps", "4", "--resume", ckpt, "--out", str(out), *extra)
        assert proc.returncode == 0, proc.stderr
        summary = json.loads((out / "summary.json").read_text())
        assert summary["run_changes"] == ["--steps 4 (checkpoint's run: 2)", *changes]
        saved = checkpoint.read(out / "checkpoints" / "step-000004.pt")
        assert saved["run"]["growth_interval"] == interval
        assert saved["scaler"]["growth_interval"] == interval
