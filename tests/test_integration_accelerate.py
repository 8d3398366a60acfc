"""shardscale.integrations.accelerate: ``use_shardscale(accelerator)`` under accelerate's own loop
(``accelerator.backward``, ``clip_grad_norm_``, a prepared optimizer and LR scheduler,
``accelerator.log``, ``save_state``/``load_state``) in fp16 on the CPU, where accelerate alone
turns fp16 off.

One scenario (:func:`run_scenario`) trains a small MLP for ``STEPS`` steps with an inf written
into one gradient on the last rank only at ``INF_STEP``, checkpoints after ``SAVE_AFTER``, rolls
back with ``load_state``, then resumes in a fresh ``Accelerator`` and replays the last steps. It
runs in the pytest process for 1 process, and on 2 gloo ranks under torch's elastic launcher
(``torch.distributed.run``, a script written to ``tmp_path``) for DDP and FSDP2.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
import textwrap
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")

from shardscale import ShardedGradScaler  # noqa: E402
from shardscale.integrations.accelerate import scaler_logs, use_shardscale  # noqa: E402

INIT_SCALE = 1024.0
GROWTH_INTERVAL = 3
STEPS = 6
INF_STEP = 2
SAVE_AFTER = 3
LAUNCH_TIMEOUT_S = 150


def expected_scales() -> list[float]:
    """The scale after each step: backoff 0.5 at ``INF_STEP``, x2 after 3 clean steps."""
    scale, tracker, out = INIT_SCALE, 0, []
    for step in range(STEPS):
        if step == INF_STEP:
            scale, tracker = scale / 2, 0
        else:
            tracker += 1
            if tracker == GROWTH_INTERVAL:
                scale, tracker = scale * 2, 0
        out.append(scale)
    return out


# ------------------------------------------------------------------ the scenario (every rank)
def _tracker() -> Any:
    from accelerate.tracking import GeneralTracker

    class ListTracker(GeneralTracker):
        """accelerate's simplest tracker: keeps what ``accelerator.log`` gets (main process)."""

        name = "list"
        requires_logging_directory = False

        def __init__(self) -> None:
            super().__init__()
            self.logged: list[dict[str, Any]] = []

        @property
        def tracker(self) -> list[dict[str, Any]]:
            return self.logged

        def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
            self.logged.append({"step": step, **values})

    return ListTracker()


def _setup(sc: dict[str, Any], tracker: Any = None) -> tuple[Any, ...]:
    """A fresh Accelerator, model, optimizer, scheduler and scaler for scenario ``sc``."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, InitProcessGroupKwargs

    kwargs: dict[str, Any] = {
        "cpu": True,
        "mixed_precision": "fp16",
        "kwargs_handlers": [InitProcessGroupKwargs(timeout=timedelta(seconds=30))],
        "log_with": [tracker] if tracker is not None else None,
    }
    plugin = None
    if sc["parallel"] == "fsdp2":
        plugin = kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(**kwargs)
    if plugin is not None:
        # accelerate 1.15 keeps DistributedType.MULTI_CPU when given an FSDP plugin on the CPU
        # (AcceleratorState switches to FSDP only for accelerator devices): set what it sets on
        # a GPU, to run accelerate's FSDP2 paths (fully_shard, DCP checkpoints, the scaler
        # loaded before the optimizer) on gloo.
        assert accelerator.distributed_type == DistributedType.MULTI_CPU
        plugin.set_mixed_precision(accelerator.mixed_precision)
        accelerator.state.fsdp_plugin = plugin
        accelerator.state.distributed_type = DistributedType.FSDP
        PartialState().distributed_type = DistributedType.FSDP  # as AcceleratorState does
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=sc["fused"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.9**s)
    scaler_kwargs = {"init_scale": INIT_SCALE, "growth_interval": GROWTH_INTERVAL}
    if sc["when"] == "before":
        scaler = use_shardscale(accelerator, **scaler_kwargs)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if sc["when"] == "after":
        scaler = use_shardscale(accelerator, **scaler_kwargs)
    if tracker is not None:
        accelerator.init_trackers("shardscale")
    return accelerator, model, optimizer, scheduler, scaler


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)


def _params(model: torch.nn.Module) -> list[float]:
    """Every parameter value (FSDP2 shards gathered: a collective)."""
    out: list[float] = []
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out += full.detach().double().reshape(-1).tolist()
    return out


def _poison(model: torch.nn.Module) -> None:
    """An inf in this rank's first gradient (its local shard under FSDP2), after backward."""
    grad = next(iter(model.parameters())).grad
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    local.view(-1)[0] = float("inf")


def _train(
    accelerator: Any,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    scaler: ShardedGradScaler,
    steps: range,
    ckpt: Path | None = None,
) -> list[dict[str, Any]]:
    from accelerate.optimizer import AcceleratedOptimizer

    rank, world = accelerator.process_index, accelerator.num_processes
    records = []
    for step in steps:
        x, y = _batch(step, rank)
        out = model(x)
        loss = torch.nn.functional.mse_loss(out, y)
        accelerator.backward(loss)
        if step == INF_STEP and rank == world - 1:
            _poison(model)
        norm = accelerator.clip_grad_norm_(model.parameters(), 100.0)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        optimizer.step()
        accelerator.log(scaler_logs(accelerator), step=step)  # before zero_grad()
        scheduler.step()
        optimizer.zero_grad()
        metrics = scaler.metrics()
        records.append(
            {
                "step": step,
                "out_dtype": str(out.dtype),
                "scale": scaler.get_scale(),
                "skipped": optimizer.step_was_skipped,
                "accelerator_skipped": accelerator.optimizer_step_was_skipped,
                # accelerate's own notion (optimizer.step called or not), kept for comparison
                "accelerate_skipped": AcceleratedOptimizer.step_was_skipped.fget(optimizer),
                "last_epoch": scheduler.scheduler.last_epoch,
                "lr": scheduler.get_last_lr()[0],
                "norm": float(norm),
                "metrics": metrics,
                "params": _params(model),
            }
        )
        if ckpt is not None and step == SAVE_AFTER:
            accelerator.save_state(str(ckpt))
    return records


def _reset_accelerate() -> None:
    """Forget accelerate's process-wide state (the process group stays)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def run_scenario(sc: dict[str, Any], ckpt: Path) -> dict[str, Any]:
    """Train, checkpoint, roll back, resume in a fresh Accelerator; return what was seen."""
    tracker = _tracker()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator, model, optimizer, scheduler, scaler = _setup(sc, tracker)
    setup = {
        "warnings": [str(w.message) for w in caught],
        "distributed_type": str(accelerator.distributed_type.value),
        "native_amp": accelerator.native_amp,
        "scaler_installed": accelerator.scaler is scaler and optimizer.scaler is scaler,
        "optimizer_class": type(optimizer).__name__,
        "model_class": type(model).__name__,
        "num_processes": accelerator.num_processes,
    }
    records = _train(accelerator, model, optimizer, scheduler, scaler, range(STEPS), ckpt)
    accelerator.load_state(str(ckpt))  # roll back to the end of step SAVE_AFTER
    rolled_back = {"metrics": scaler.metrics(), "params": _params(model)}
    logged = list(tracker.logged)
    saved = torch.load(ckpt / "scaler.pt", weights_only=True)

    _reset_accelerate()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # fp16 on the CPU: checked in `setup`
        accelerator, model, optimizer, scheduler, scaler = _setup(sc)
    accelerator.load_state(str(ckpt))
    resumed = {
        "metrics": scaler.metrics(),
        "last_epoch": scheduler.scheduler.last_epoch,
        "params": _params(model),
        "records": _train(
            accelerator, model, optimizer, scheduler, scaler, range(SAVE_AFTER + 1, STEPS)
        ),
    }
    _reset_accelerate()
    return {
        "setup": setup,
        "records": records,
        "logged": logged,
        "saved": saved,
        "rolled_back": rolled_back,
        "resumed": resumed,
    }


def worker_main(config_path: str) -> None:
    """Entry point of each rank under ``torch.distributed.run``: run the scenarios of the
    config, write ``rank{r}.json``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    cfg = json.loads(Path(config_path).read_text())
    out = Path(cfg["out"])
    results = [run_scenario(sc, out / sc["name"]) for sc in cfg["scenarios"]]
    rank = dist.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()
    # After an FSDP2 (DCP) checkpoint, torch's C++ teardown at interpreter exit sometimes aborts
    # on a loaded machine ("terminate called without an active exception", no Python frame).
    # Everything is written: leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(tmp_path: Path, scenarios: list[dict[str, Any]], nproc: int = 2) -> list[list[dict]]:
    """Run ``scenarios`` on ``nproc`` ranks under torch's elastic launcher; each rank's results."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"out": str(tmp_path), "scenarios": scenarios}))
    script = tmp_path / "worker.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(Path(__file__).parent)!r})
            from test_integration_accelerate import worker_main
            worker_main({str(config)!r})
            """
        )
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # rendezvous on a free port
        f"--nproc-per-node={nproc}",
        str(script),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]


# ------------------------------------------------------------------------- checks (pytest)
def check_scenario(
    ranks: list[dict[str, Any]], fused: bool, out_dtype: str = "torch.float32"
) -> None:
    """What every rank must have seen in :func:`run_scenario`'s run."""
    world = len(ranks)
    scales = expected_scales()
    for res in ranks:
        setup = res["setup"]
        assert setup["native_amp"] and setup["scaler_installed"]
        assert setup["optimizer_class"] == "ShardscaleAcceleratedOptimizer"
        assert setup["num_processes"] == world
        assert any("fp16 on the CPU is slow" in w for w in setup["warnings"]), setup["warnings"]
        stepped = 0
        for rec in res["records"]:
            step = rec["step"]
            skip = step == INF_STEP
            stepped += not skip
            assert rec["out_dtype"] == out_dtype  # fp32: accelerate's autocast wrapper
            assert rec["scale"] == scales[step]
            assert rec["skipped"] is skip and rec["accelerator_skipped"] is skip
            # accelerate alone (accelerate#4242): a fused step is never "skipped"
            assert rec["accelerate_skipped"] is (skip and not fused)
            # AcceleratedScheduler steps num_processes times per optimizer step, none on a skip
            assert rec["last_epoch"] == world * stepped
            assert rec["lr"] == pytest.approx(0.05 * 0.9 ** (world * stepped))
            m = rec["metrics"]
            assert m["scale"] == scales[step] and m["last_step_skipped"] == skip
            assert m["skipped_steps"] == (step >= INF_STEP) and m["steps"] == step + 1
            if not skip:
                assert math.isfinite(rec["norm"])
        recs = res["records"]
        # the skipped step left every parameter as it was; the others moved them
        assert recs[INF_STEP]["params"] == recs[INF_STEP - 1]["params"]
        assert recs[INF_STEP + 1]["params"] != recs[INF_STEP]["params"]
        # the checkpoint: the scaler state after step SAVE_AFTER, restored exactly
        saved = res["saved"]
        assert saved["scale"] == scales[SAVE_AFTER] == INIT_SCALE / 2
        assert saved["_growth_tracker"] == SAVE_AFTER - INF_STEP
        assert saved["_counters"]["skipped_steps"] == 1
        at_save = recs[SAVE_AFTER]
        for restored in (res["rolled_back"], res["resumed"]):
            assert restored["metrics"] == {**at_save["metrics"], "last_step_skipped": 0}
            assert restored["params"] == at_save["params"]
        resumed = res["resumed"]
        assert resumed["last_epoch"] == at_save["last_epoch"]
        # resumed from step SAVE_AFTER: the same scales (the growth tracker went on: x2 at the
        # end), parameters and learning rates as the uninterrupted run
        for rec in resumed["records"]:
            ref = recs[rec["step"]]
            for key in ("scale", "skipped", "last_epoch", "lr", "metrics", "params"):
                assert rec[key] == ref[key], (key, rec["step"])
        assert resumed["records"][-1]["scale"] == INIT_SCALE
    # replicas identical on every step: scale, skip, parameters, clean-step norms
    for step in range(STEPS):
        ref = ranks[0]["records"][step]
        for res in ranks[1:]:
            rec = res["records"][step]
            assert rec["params"] == ref["params"] and rec["metrics"] == ref["metrics"]
            if step != INF_STEP:
                assert rec["norm"] == ref["norm"]
    # accelerator.log on the main process: the scale and the skips
    assert ranks[0]["logged"] == [
        {"step": s, "loss_scale": scales[s], "skipped_steps": int(s >= INF_STEP)}
        for s in range(STEPS)
    ]
    assert all(res["logged"] == [] for res in ranks[1:])


@pytest.fixture
def fresh_accelerate():
    """accelerate keeps process-wide state: start and end each in-process test without it."""
    _reset_accelerate()
    yield
    _reset_accelerate()


@pytest.mark.parametrize(
    "fused,when", [(False, "before"), (True, "after")], ids=["unfused-before", "fused-after"]
)
def test_one_process(tmp_path, fresh_accelerate, fused, when):
    res = run_scenario({"parallel": "none", "fused": fused, "when": when}, tmp_path / "ckpt")
    assert res["setup"]["distributed_type"] == "NO"
    assert res["setup"]["model_class"] == "Sequential"
    check_scenario([res], fused)


def test_import_shardscale_does_not_import_accelerate():
    code = (
        "import sys, shardscale, shardscale.integrations, shardscale.integrations.accelerate\n"
        "assert 'accelerate' not in sys.modules, 'accelerate imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_cpu_fp16_autocast_after_prepare(fresh_accelerate):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    assert not accelerator.native_amp and accelerator.scaler is None  # accelerate: fp16 is off
    model = accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)))
    dtypes: list[torch.dtype] = []
    model[0].register_forward_hook(lambda m, i, out: dtypes.append(out.dtype))
    x = torch.randn(2, 4)
    assert model(x).dtype == torch.float32 and dtypes == [torch.float32]
    with pytest.warns(UserWarning, match="fp16 on the CPU is slow: use it for testing"):
        scaler = use_shardscale(accelerator)
    assert accelerator.native_amp and accelerator.scaler is scaler
    assert scaler.get_scale() == 2.0**16 and scaler.config.dynamic
    assert model(x).dtype == torch.float32 and dtypes[-1] == torch.float16  # fp32 outputs
    with accelerator.autocast():
        assert (x @ x.T).dtype == torch.float16
    plain = accelerator.unwrap_model(model, keep_fp32_wrapper=False)  # accelerate's unwrapping
    assert plain(x).dtype == torch.float32 and dtypes[-1] == torch.float32


@pytest.mark.parametrize("precision", ["bf16", "no"])
def test_bf16_and_fp32_get_a_guard(fresh_accelerate, precision):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, mixed_precision=precision)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fp16 warning
        scaler = use_shardscale(accelerator, max_consecutive_skips=3)
    assert not scaler.config.dynamic and scaler.config.max_consecutive_skips == 3
    before = model.weight.detach().clone()
    for poison in (True, False):
        accelerator.backward(model(torch.randn(2, 4)).float().sum())
        if poison:
            model.weight.grad[0, 0] = float("nan")
        optimizer.step()
        optimizer.zero_grad()
        assert optimizer.step_was_skipped is poison
        assert torch.equal(model.weight, before) is poison
    assert scaler.metrics()["scale"] == 1.0 and scaler.metrics()["skipped_steps"] == 1
    # an adopted optimizer pickles (its class is found by name)
    copy = pickle.loads(pickle.dumps(optimizer))
    assert type(copy) is type(optimizer) and type(copy).__name__ == "ShardscaleAcceleratedOptimizer"
    # accelerate unscales only fp16 gradients: a guard's init_scale would clip scaled ones
    with pytest.warns(UserWarning, match="init_scale is ignored"):
        scaler = use_shardscale(accelerator, init_scale=1024.0)
    assert scaler.get_scale() == 1.0
    accelerator.backward(model(torch.ones(2, 4)).float().sum())  # grads: 2 each (w: 4, b: 1)
    assert accelerator.clip_grad_norm_(model.parameters(), 1e9).item() == pytest.approx(20**0.5)
    optimizer.step()
    optimizer.zero_grad()


def test_scaler_state_carries_over(fresh_accelerate):
    """A GradScaler the accelerator had (accelerate's, maybe loaded from a checkpoint) hands its
    scale and growth tracker over, unless init_scale is given."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    old = torch.amp.GradScaler("cpu", growth_interval=10)
    old.load_state_dict({**old.state_dict(), "scale": 512.0, "_growth_tracker": 7})
    accelerator.scaler = old
    with pytest.warns(UserWarning, match="fp16"):
        scaler = use_shardscale(accelerator, growth_interval=100)
    m = scaler.metrics()
    assert (m["scale"], m["growth_tracker"], scaler.get_growth_interval()) == (512.0, 7, 100)
    again = use_shardscale(accelerator, init_scale=8.0)  # replaces it (fp16 is on: no warning)
    assert accelerator.scaler is again and again.metrics()["scale"] == 8.0


def test_scaler_logs_with_gradient_accumulation(fresh_accelerate):
    """scaler_logs(accelerator) after optimizer.step(), to accelerator.log: loss_scale and
    skipped_steps on every call; with policy="headroom", on the steps taken, headroom_bits and
    underflow as computed by hand from the step's gradients (-inf headroom on the overflow),
    none on accumulation micro-steps."""
    from accelerate import Accelerator

    tracker = _tracker()
    accelerator = Accelerator(
        cpu=True, mixed_precision="fp16", gradient_accumulation_steps=2, log_with=[tracker]
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    tiny = torch.nn.Parameter(torch.ones(4))  # gradient 1e-12: underflows in fp16
    optimizer = torch.optim.AdamW([*model.parameters(), tiny], lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    with pytest.warns(UserWarning, match="fp16"):
        scaler = use_shardscale(accelerator, policy="headroom", init_scale=INIT_SCALE)
    accelerator.init_trackers("shardscale")
    params = [*model.parameters(), tiny]
    seen = []
    for micro in range(8):  # 4 optimizer steps
        x, y = _batch(micro, 0)
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y) + 1e-12 * tiny.sum()
            accelerator.backward(loss)
            if micro == 3:
                _poison(model)
            used = scaler.get_scale()
            optimizer.step()
            logs = scaler_logs(accelerator)
            accelerator.log(logs, step=micro)
            if accelerator.sync_gradients:
                g = torch.cat([p.grad.reshape(-1) for p in params]).double().abs()
                top = float(g.max()) * used
                hand = (math.log2(65504 / top) if math.isfinite(top) else -top,
                        float((g * used < 2**-14).double().mean()))  # fmt: skip
                seen.append((micro, logs, hand, scaler.get_scale()))
            else:
                assert set(logs) == {"loss_scale", "skipped_steps"}, micro
            optimizer.zero_grad()
    assert [m for m, *_ in seen] == [1, 3, 5, 7]
    for micro, logs, (headroom, under), scale in seen:
        assert logs["loss_scale"] == scale and logs["skipped_steps"] == int(micro >= 3)
        if micro == 3:
            assert logs["headroom_bits"] == headroom == -math.inf
        else:
            assert (logs["headroom_bits"], logs["underflow"]) == pytest.approx((headroom, under))
            assert 0 < headroom < 16 and under >= 4 / 62  # tiny's 4 of the 62 elements
    assert [e["step"] for e in tracker.logged] == list(range(8))
    assert tracker.logged[5] == {"step": 5, **seen[2][1]}
    # after zero_grad() (set to None), or asked not to: loss_scale and skipped_steps only
    assert set(scaler_logs(scaler)) == {"loss_scale", "skipped_steps"}
    assert set(scaler_logs(scaler, numerics=False)) == {"loss_scale", "skipped_steps"}
    with pytest.raises(TypeError, match="numerics must be a bool or None"):
        scaler_logs(scaler, numerics=1)
    with pytest.raises(TypeError, match="set up by use_shardscale"):
        scaler_logs(Accelerator(cpu=True))


def test_refused_setups():
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    for kind, precision in (("DEEPSPEED", "fp16"), ("XLA", "bf16"), ("NO", "fp8")):
        fake = SimpleNamespace(distributed_type=DistributedType[kind], mixed_precision=precision)
        with pytest.raises(ValueError, match="does its own loss scaling"):
            use_shardscale(fake)


@pytest.mark.dist
def test_ddp_two_ranks(tmp_path):
    scenarios = [
        {"name": "unfused", "parallel": "ddp", "fused": False, "when": "before"},
        {"name": "fused", "parallel": "ddp", "fused": True, "when": "after"},
    ]
    ranks = launch(tmp_path, scenarios)
    for i, sc in enumerate(scenarios):
        per_rank = [r[i] for r in ranks]
        assert per_rank[0]["setup"]["distributed_type"] == "MULTI_CPU"
        assert per_rank[0]["setup"]["model_class"] == "DistributedDataParallel"
        check_scenario(per_rank, sc["fused"])


@pytest.mark.dist
def test_fsdp2_two_ranks(tmp_path):
    scenarios = [{"name": "fused", "parallel": "fsdp2", "fused": True, "when": "before"}]
    ranks = launch(tmp_path, scenarios)
    per_rank = [r[0] for r in ranks]
    assert per_rank[0]["setup"]["distributed_type"] == "FSDP"
    # FSDP2 computes in fp16 by its MixedPrecisionPolicy (output_dtype fp16), not by autocast
    check_scenario(per_rank, fused=True, out_dtype="torch.float16")
