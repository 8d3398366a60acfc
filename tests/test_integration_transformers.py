"""``transformers.Trainer`` with ``ShardscaleCallback``, on 1 process and on 2 DDP ranks (gloo,
started by torch's elastic launcher), fp16 on the CPU, ``adamw_torch`` and ``adamw_torch_fused``.

Each launch runs every scenario in the same processes (this file is the worker script) and
writes one JSON file per rank; the tests read them. In every run an inf is written into one
gradient of the *last* rank only, at optimizer step ``SKIP_AT``, just before the scaler reads the
gradients (after DDP's all-reduce: the scaler's own all-reduce is what makes the other rank skip).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

STEPS = 8  # optimizer steps per run
SKIP_AT = 4  # the global step whose gradients get the inf (1-based, as trainer.state)
SAVE_AT = 5  # save_steps: checkpoint-5 is resumed
LR = 1e-3
INIT_SCALE, GROWTH_INTERVAL = 2.0**10, 3
# init 1024, x2 after 3 clean steps, /2 on the overflow at step 4 (tracker back to 0):
EXPECTED_SCALES = [1024.0, 1024.0, 2048.0, 1024.0, 1024.0, 1024.0, 2048.0, 2048.0]
EXPECTED_SKIPPED = [0, 0, 0, 1, 1, 1, 1, 1]
TIMEOUT_S = 150


# ------------------------------------------------------------------ worker (a subprocess)
def _data(n: int = 64) -> list[dict[str, Any]]:
    import torch

    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    return [{"x": x[i], "labels": int(x[i].sum() > 0)} for i in range(n)]


def _model(tiny: bool = False) -> Any:
    """An MLP (354 parameters); ``tiny``: and 4 more whose gradient (1e-12) underflows in fp16
    at any scale below 2**26."""
    import torch
    from torch import nn

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.out = nn.Linear(8, 32), nn.Linear(32, 2)
            self.tiny = nn.Parameter(torch.ones(4)) if tiny else None
            self.seen_dtype = ""

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            h = self.inp(x)
            self.seen_dtype = str(h.dtype)  # autocast's compute dtype
            logits = self.out(torch.relu(h))
            loss = nn.functional.cross_entropy(logits.float(), labels)
            if self.tiny is not None:
                loss = loss + 1e-12 * self.tiny.sum()
            return {"loss": loss, "logits": logits}

    torch.manual_seed(0)
    return MLP()


def _run(
    out: Path, name: str, optim: str, precision: str = "fp16", resume: str | None = None
) -> dict[str, Any]:
    """One Trainer run; returns what the tests check. A resumed run starts after SKIP_AT."""
    import torch
    import torch.distributed as dist
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from shardscale.integrations.transformers import ShardscaleCallback

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    args = TrainingArguments(
        str(out / name),
        fp16=precision == "fp16",
        bf16=precision == "bf16",
        optim=optim,
        learning_rate=LR,
        lr_scheduler_type="linear",
        max_steps=STEPS,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_steps=SAVE_AT,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        ddp_find_unused_parameters=False,
        ddp_timeout=60,
        seed=0,
    )
    if precision == "fp16":
        callback = ShardscaleCallback(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    else:  # guard mode: the scale stays at 1.0 (an init_scale given here would be kept)
        callback = ShardscaleCallback()
    seen: dict[str, Any] = {}

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen["begin"] = callback.scaler.state_dict()  # after the Trainer loaded scaler.pt

        def on_save(self, args, state, control, **kwargs):
            seen[f"saved{state.global_step}"] = callback.scaler.state_dict()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(
            model=_model(), args=args, train_dataset=_data(), callbacks=[callback, Probe()]
        )
    cpu_warning = [w for w in caught if "fp16 on the CPU is slow" in str(w.message)]

    # the inf: on the last rank only, right before the scaler reads the gradients (the
    # Trainer computes the grad norm, and so unscales, before any callback runs)
    unscale = trainer.accelerator.unscale_gradients

    def unscale_with_inf(optimizer=None):
        if rank == world - 1 and trainer.state.global_step == SKIP_AT - 1:
            trainer.model.out.weight.grad[0, 0] = float("inf")
        return unscale(optimizer)

    trainer.accelerator.unscale_gradients = unscale_with_inf
    trainer.train(resume_from_checkpoint=resume)

    params = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])
    result = {
        "history": [
            {k: e[k] for k in ("step", "learning_rate", "loss_scale", "skipped_steps")}
            for e in trainer.state.log_history
            if "loss" in e
        ],
        "numerics_logged": any("headroom_bits" in e for e in trainer.state.log_history),
        "final": callback.scaler.state_dict(),
        "metrics": callback.scaler.metrics(),
        "scheduler_steps": trainer.lr_scheduler.last_epoch,
        "params_sha": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
        "params_finite": bool(params.isfinite().all()),
        "dtype": trainer.model.seen_dtype,
        "fused": bool(trainer.optimizer.optimizer.defaults["fused"]),
        "cpu_warning": len(cpu_warning),
        "warning_file": cpu_warning[0].filename if cpu_warning else None,
        "first_callback": type(trainer.callback_handler.callbacks[0]).__name__,
        "world": dist.get_world_size() if dist.is_initialized() else 1,
        **seen,
    }
    if resume is not None:
        result["scaler_pt"] = torch.load(Path(resume) / "scaler.pt", weights_only=True)
    return result


def _numerics_run(out: Path, name: str, **kw: Any) -> dict[str, Any]:
    """A run logging headroom_bits and underflow: the logged figures, those computed by hand
    from the gradients after each optimizer step (by the global step), and the steps measured."""
    import math

    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from shardscale.integrations.transformers import ShardscaleCallback

    callback_kw, n = kw.pop("callback"), kw.pop("n", 64)
    args = TrainingArguments(
        str(out / name), fp16=True, max_steps=8, per_device_train_batch_size=4, report_to="none",
        disable_tqdm=True, use_cpu=True, save_strategy="no", seed=0, **kw,
    )  # fmt: skip
    callback = ShardscaleCallback(init_scale=INIT_SCALE, **callback_kw)
    hand: dict[int, list[float]] = {}
    measured: list[int] = []

    class Probe(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.scale = callback.scaler.get_scale()  # the scale of this step's gradients

        def on_optimizer_step(self, args, state, control, **kwargs):
            g = torch.cat([p.grad.reshape(-1) for p in trainer.model.parameters()]).double().abs()
            top = float(g.max()) * self.scale
            headroom = math.log2(65504 / top) if math.isfinite(top) else -top
            hand[state.global_step + 1] = [
                headroom,
                float((g * self.scale < 2**-14).double().mean()),
            ]

    trainer = Trainer(
        model=_model(tiny=True), args=args, train_dataset=_data(n), callbacks=[callback, Probe()]
    )
    numerics = callback.scaler.numerics

    def counted() -> Any:
        measured.append(trainer.state.global_step + 1)
        return numerics()

    callback.scaler.numerics = counted
    trainer.train()
    logged = {
        e["step"]: [e["headroom_bits"], e["underflow"]]
        for e in trainer.state.log_history
        if "loss" in e and "headroom_bits" in e
    }
    logs = [e["step"] for e in trainer.state.log_history if "loss" in e]
    others = [e for e in trainer.state.log_history if "loss" not in e and "headroom_bits" in e]
    return {"logged": logged, "hand": hand, "measured": measured, "logs": logs, "others": others}


def _errors(out: Path) -> dict[str, str]:
    """Misuse, on one process: the messages raised."""
    from transformers import Trainer, TrainingArguments

    from shardscale.integrations.transformers import ShardscaleCallback

    found = {}
    try:
        ShardscaleCallback(init_scale=0.0)
    except ValueError as exc:
        found["bad_kwarg"] = str(exc)
    args = TrainingArguments(
        str(out / "late"), fp16=True, max_steps=1, report_to="none", disable_tqdm=True
    )
    trainer = Trainer(model=_model(), args=args, train_dataset=_data(8))
    trainer.add_callback(ShardscaleCallback())
    try:
        trainer.train()
    except RuntimeError as exc:
        found["late"] = str(exc)
    return found


def _worker(out: Path) -> None:
    import torch

    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    runs = {
        "unfused": _run(out, "unfused", "adamw_torch"),
        "fused": _run(out, "fused", "adamw_torch_fused"),
    }
    runs["resumed"] = _run(
        out, "resumed", "adamw_torch", resume=str(out / "unfused" / f"checkpoint-{SAVE_AT}")
    )
    if world == 1:
        runs["bf16"] = _run(out, "bf16", "adamw_torch_fused", precision="bf16")
        runs["errors"] = _errors(out)
        runs["numerics_steps"] = _numerics_run(
            out, "numerics_steps", callback={"policy": "headroom"}, optim="adamw_torch_fused",
            logging_steps=3, logging_first_step=True,
        )  # fmt: skip
        runs["numerics_epoch"] = _numerics_run(
            out, "numerics_epoch", callback={"log_numerics": True}, logging_strategy="epoch", n=16
        )
    (out / f"rank{rank}.json").write_text(json.dumps(runs))
    # Leave without the interpreter's teardown: CPU DDP processes of the Trainer sometimes abort
    # there ("terminate called without an active exception", with or without shardscale).
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ------------------------------------------------------------------------ launches
def _launch(tmp_path_factory: pytest.TempPathFactory, nproc: int) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp(f"trainer{nproc}")
    me = str(Path(__file__).resolve())
    if nproc == 1:
        cmd = [sys.executable, me, str(out)]
    else:
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        cmd = [sys.executable, *launcher, me, str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": ""}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _launch(tmp_path_factory, 1)[0]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _launch(tmp_path_factory, 2)


def _expected_lr(step: int) -> float:
    """Linear decay from LR over STEPS scheduler steps; the skipped step does not count."""
    scheduler_steps = step - 1 - (step > SKIP_AT)
    return LR * (1 - scheduler_steps / STEPS)


def _check_run(run: dict[str, Any], precision: str = "fp16") -> None:
    history = run["history"]
    assert [e["step"] for e in history] == list(range(1, STEPS + 1))
    scales = [1.0] * STEPS if precision == "bf16" else EXPECTED_SCALES
    assert [e["loss_scale"] for e in history] == scales
    assert [e["skipped_steps"] for e in history] == EXPECTED_SKIPPED
    lrs = [e["learning_rate"] for e in history]
    assert lrs == pytest.approx([_expected_lr(s) for s in range(1, STEPS + 1)], rel=1e-12)
    assert lrs[SKIP_AT] == lrs[SKIP_AT - 1]  # the step after the skipped one: same LR
    assert all(a > b for a, b in zip(lrs[SKIP_AT:], lrs[SKIP_AT + 1 :], strict=False))
    assert run["scheduler_steps"] == STEPS - 1
    assert run["params_finite"]
    assert run["dtype"] == f"torch.{'float16' if precision == 'fp16' else 'bfloat16'}"
    assert run["first_callback"] == "ShardscaleCallback"
    final = run["final"]
    assert (run["metrics"]["scale"], run["metrics"]["skipped_steps"]) == (final["scale"], 1)
    counters = final["_counters"]
    assert counters["steps"] == STEPS and counters["skipped_steps"] == 1
    if precision == "fp16":
        assert (final["scale"], final["_growth_tracker"]) == (2048.0, 1)
        assert counters["backoffs"] == 1 and counters["growths"] == 2
    else:
        assert final["scale"] == 1.0 and final["dynamic"] is False


# --------------------------------------------------------------------------- tests
def test_import_shardscale_does_not_import_transformers() -> None:
    code = (
        "import sys, shardscale, shardscale.integrations; "
        "assert not {'transformers', 'accelerate'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("name", ["unfused", "fused"])
def test_single_process_fp16_skip_scale_lr_logs(single: dict[str, Any], name: str) -> None:
    run = single[name]
    _check_run(run)
    assert run["world"] == 1
    assert run["fused"] is (name == "fused")
    assert run["cpu_warning"] == 1
    assert run["warning_file"] == str(Path(__file__).resolve())  # points at `Trainer(...)`


def test_single_process_bf16_guard(single: dict[str, Any]) -> None:
    _check_run(single["bf16"], precision="bf16")
    assert single["bf16"]["cpu_warning"] == 0


@pytest.mark.parametrize("launch", ["single", pytest.param("ddp", marks=pytest.mark.dist)])
def test_resume_restores_the_scaler_exactly(request: pytest.FixtureRequest, launch: str) -> None:
    found = request.getfixturevalue(launch)
    for rank_runs in found if isinstance(found, list) else [found]:
        first, resumed = rank_runs["unfused"], rank_runs["resumed"]
        saved = first[f"saved{SAVE_AT}"]
        # at step 5: scale 1024, one clean step since the backoff (a lost tracker would be 0)
        assert (saved["scale"], saved["_growth_tracker"]) == (1024.0, 1)
        assert saved["_counters"]["skipped_steps"] == 1
        assert resumed["scaler_pt"] == saved
        assert resumed["begin"] == saved
        # the resumed run continues exactly: same scales, LRs, final scaler and parameters
        assert resumed["history"] == first["history"]
        assert resumed["final"] == first["final"]
        assert resumed["params_sha"] == first["params_sha"]


@pytest.mark.dist
@pytest.mark.parametrize("name", ["unfused", "fused"])
def test_ddp_every_rank_skips_the_one_rank_overflow(ddp: list[dict[str, Any]], name: str) -> None:
    runs = [rank_runs[name] for rank_runs in ddp]
    for run in runs:
        assert run["world"] == 2
        assert run["fused"] is (name == "fused")
        _check_run(run)  # rank 0 never saw an inf, and skipped step 4 too
    assert runs[0]["history"] == runs[1]["history"]
    assert runs[0]["final"] == runs[1]["final"]
    assert runs[0]["params_sha"] == runs[1]["params_sha"]  # replicas identical


@pytest.mark.parametrize(
    "name, logs, measured",
    [("numerics_steps", [1, 3, 6], [1, 3, 6]), ("numerics_epoch", [4, 8], list(range(1, 9)))],
)
def test_logs_carry_headroom_and_underflow(
    single: dict[str, Any], name: str, logs: list[int], measured: list[int]
) -> None:
    """policy="headroom" (or log_numerics=True): the logs of training steps, and no other,
    carry the figures of the step's gradients, computed by hand after the optimizer step; measured only on the
    steps that log (every step with logging_strategy="epoch")."""
    run = single[name]
    assert run["logs"] == logs and run["measured"] == measured
    assert sorted(int(k) for k in run["logged"]) == logs
    assert run["others"] == []  # not the end-of-training summary (train_runtime, train_loss)
    for step, figures in run["logged"].items():
        assert figures == pytest.approx(run["hand"][step], rel=1e-9)
        assert 0 < figures[0] < 16 and figures[1] >= 4 / 358  # tiny's 4, and zeros
    assert not single["unfused"]["numerics_logged"]  # the torch policy, log_numerics None


def test_misuse_is_refused(single: dict[str, Any]) -> None:
    errors = single["errors"]
    assert "init_scale" in errors.get("bad_kwarg", "")
    assert "Trainer(callbacks=[ShardscaleCallback()])" in errors.get("late", "")


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
