"""shardscale.integrations.lightning: ShardscalePrecision and LossScaleMonitor in the Trainer, in
Fabric and from a LightningCLI config; one process and 2 gloo ranks (DDP, FSDP1, FSDP2).

Every training run takes STEPS optimizer steps of fp16 (on the CPU) with an inf written into one
gradient at step INF_STEP (0-based), on one rank only in the 2-rank runs. Expected on every rank:
that step is skipped, the scale halves (2**10 -> 2**9), the parameters do not move on it, the
LR scheduler (``interval="step"``) does not advance on it, the values are logged, and a
checkpoint written by Lightning restores the scaler exactly.

The 2-rank runs fork 2 processes with a gloo group and ``LOCAL_RANK`` set, as torchrun does;
Lightning then runs ``strategy="ddp"`` / ``FSDPStrategy`` / ``ModelParallelStrategy`` with
``devices=2, accelerator="cpu"`` in them (no launcher of its own). All runs share one launch.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.distributed.tensor import DTensor

L = pytest.importorskip("lightning")

from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel  # noqa: E402
from lightning.pytorch.loggers import CSVLogger, Logger  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy  # noqa: E402

import shardscale.integrations.lightning as sl  # noqa: E402
from shardscale import ShardedGradScaler  # noqa: E402
from shardscale.integrations.lightning import LossScaleMonitor, ShardscalePrecision  # noqa: E402

STEPS = 6
INF_STEP = 2
INIT = 2.0**10
CLIP = 0.01  # below every gradient norm here: each clean step is clipped
SCALES = [INIT] * INF_STEP + [INIT / 2] * (STEPS - INF_STEP)
SKIPPED = [i == INF_STEP for i in range(STEPS)]
SCHED = [i + (i < INF_STEP) for i in range(STEPS)]  # scheduler.last_epoch after each step
TRACKER = STEPS - INF_STEP - 1  # clean steps since the backoff
SCALER_KW = {"init_scale": INIT, "growth_interval": 100}


# ------------------------------------------------------------------ the model and recorders
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Net(L.LightningModule):
    """A 2-layer MLP; AdamW (fused or not) and LambdaLR(1 / (1 + step)) stepped per step."""

    def __init__(self, fused: bool = False, inf_rank: int = 0, wrap: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.fused, self.inf_rank, self.wrap = fused, inf_rank, wrap
        self.out_dtypes: list[torch.dtype] = []
        self.scaled_norms: list[float] = []

    def configure_model(self) -> None:
        if self.wrap == "fsdp1" and not isinstance(self.net, FSDP1):
            # Lightning wraps with device_id=None on the CPU, which FSDP1 refuses: wrap here
            mp = self.trainer.strategy.mixed_precision_config  # the plugin's
            cpu = torch.device("cpu")
            self.net = FSDP1(self.net, device_id=cpu, use_orig_params=True, mixed_precision=mp)
        elif self.wrap == "fsdp2":
            _fsdp2(self.net, self.device_mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        self.out_dtypes.append(out.dtype)
        loss = F.mse_loss(out.float(), y)
        self.log("train_loss", loss)
        return loss

    def on_after_backward(self) -> None:  # gradients still scaled here
        self.scaled_norms.append(_grad_sumsq(self.parameters()) ** 0.5)
        if self.global_step == INF_STEP and self.global_rank == self.inf_rank:
            for p in self.parameters():
                if p.grad is not None and _local(p.grad).numel():
                    _local(p.grad).view(-1)[0] = float("inf")
                    break

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.05, fused=self.fused)
        sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sch, "interval": "step"}}


class HookNet(Net):
    """Overrides on_before_optimizer_step: the plugin unscales before the hooks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hook_norms: list[float] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.hook_norms.append(_grad_sumsq(self.parameters()) ** 0.5)


def _grad_sumsq(params: Any, divide_by: float = 1.0) -> float:
    total = 0.0
    for p in params:
        if p.grad is not None:
            total += float(_local(p.grad).double().div(divide_by).pow(2).sum())
    return total


class Record(L.Callback):
    """Per optimizer step: the scale, the skip flag, the scheduler, the local parameters, and the
    local sum of squares of the gradients the optimizer applies (a fused optimizer's divided by
    its ``grad_scale``); at the start of training, the scaler state (after a resume: restored)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.applied: list[float] = []
        self.start_state: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start_state = trainer.precision_plugin.scaler.state_dict()
        self._seen = trainer.global_step
        opt = trainer.optimizers[0]

        def pre_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            gs = getattr(optimizer, "grad_scale", None)
            div = 1.0 if gs is None else float(gs)
            self.applied.append(_grad_sumsq(pl_module.parameters(), div))

        self._hook = opt.register_step_pre_hook(pre_step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._hook.remove()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == self._seen:
            return  # accumulating: no step in this batch
        self._seen = trainer.global_step
        scaler = trainer.precision_plugin.scaler
        sch = trainer.lr_scheduler_configs[0].scheduler
        params = [_local(p).detach().float().flatten() for p in pl_module.parameters()]
        self.rows.append(
            {
                "scale": scaler.get_scale(),
                "skipped": bool(scaler.last_step_skipped()),
                "sched": sch.last_epoch,
                "lr": sch.optimizer.param_groups[0]["lr"],
                "params": torch.cat(params).clone(),
            }
        )


class MemoryLogger(Logger):
    """Keeps what the Trainer's loggers receive, on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))

    def series(self, key: str) -> dict[int | None, float]:
        return {step: m[key] for step, m in self.rows if key in m}


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(
        torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g)
    )
    return torch.utils.data.DataLoader(ds, batch_size=8)


def _fit(
    module: Net,
    steps: int,
    logger: Any,
    ckpt_path: str | None = None,
    strategy: Any = "auto",
    devices: int = 1,
    plugin: Any = None,
    monitor: LossScaleMonitor | None = None,
    callbacks: tuple[L.Callback, ...] = (),
    **trainer_kw: Any,
) -> tuple[L.Trainer, Record]:
    record = Record()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        plugins=[plugin or ShardscalePrecision("16-mixed", **SCALER_KW)],
        callbacks=[monitor or LossScaleMonitor(), record, *callbacks],
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **{"log_every_n_steps": 1, **trainer_kw},
    )
    trainer.fit(module, _loader(), ckpt_path=ckpt_path)
    return trainer, record


def _check_run(rows: list[dict[str, Any]]) -> None:
    """The skipped step, the scale, the scheduler and the parameters, step by step."""
    assert len(rows) == STEPS
    assert [r["scale"] for r in rows] == SCALES
    assert [r["skipped"] for r in rows] == SKIPPED
    assert [r["sched"] for r in rows] == SCHED
    assert [r["lr"] for r in rows] == pytest.approx([0.05 / (1 + s) for s in SCHED])
    before = [None, *(r["params"] for r in rows[:-1])]
    for i, (prev, row) in enumerate(zip(before, rows, strict=True)):
        if prev is not None:
            assert torch.equal(prev, row["params"]) == SKIPPED[i], i


def _check_logged(series: dict[Any, dict[int | None, float]]) -> None:
    """LossScaleMonitor's values, by the Trainer's logging step (0-based step index)."""
    assert series["loss_scale"] == dict(enumerate(SCALES))
    skipped = [float(i >= INF_STEP) for i in range(STEPS)]
    assert series["skipped_steps"] == dict(enumerate(skipped))
    assert series["overflows"] == dict(enumerate(skipped))


# ------------------------------------------------------------------ one process
@pytest.mark.parametrize(
    "fused, hooks", [(False, False), (True, False), (False, True), (True, True)]
)
def test_trainer_fp16_single_process(tmp_path: Path, fused: bool, hooks: bool) -> None:
    """fp16 on the CPU with gradient_clip_val (norm): the skipped step, scale, scheduler, clip,
    CSVLogger values, and a checkpoint resumed with trainer.fit(ckpt_path=...)."""
    module = (HookNet if hooks else Net)(fused=fused)
    trainer, record = _fit(module, STEPS, CSVLogger(tmp_path), gradient_clip_val=CLIP)
    _check_run(record.rows)
    assert set(module.out_dtypes) == {torch.float16}  # real fp16 autocast on the CPU
    # the optimizer applies gradients of norm CLIP on every clean step; a skipped non-fused
    # step is not called, a fused one is called and skips in its kernel
    assert len(record.applied) == (STEPS if fused else STEPS - 1)
    applied = [a for i, a in enumerate(record.applied) if not (fused and i == INF_STEP)]
    assert [math.sqrt(a) for a in applied] == pytest.approx([CLIP] * (STEPS - 1), rel=1e-4)
    if hooks:  # on_before_optimizer_step sees unscaled, unclipped gradients
        scale_at = [INIT] * (INF_STEP + 1) + [INIT / 2] * (STEPS - INF_STEP - 1)
        for i in range(STEPS):
            if i != INF_STEP:
                unscaled = module.scaled_norms[i] / scale_at[i]
                assert module.hook_norms[i] == pytest.approx(unscaled, rel=1e-5)
                assert unscaled > 10 * CLIP
    # the CSV file written by Lightning's CSVLogger
    trainer.logger.save()
    lines = Path(trainer.logger.log_dir, "metrics.csv").read_text().splitlines()
    header = lines[0].split(",")
    series: dict[str, dict[int, float]] = {
        k: {} for k in ("loss_scale", "skipped_steps", "overflows")
    }
    for line in lines[1:]:
        row = dict(zip(header, line.split(","), strict=True))
        for k in series:
            if row.get(k):
                series[k][int(row["step"])] = float(row[k])
    _check_logged(series)

    # Lightning's own checkpoint: saved, then resumed by a Trainer with a fresh plugin
    end_state = trainer.precision_plugin.scaler.state_dict()
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)["ShardscalePrecision"]
    assert saved == end_state
    assert (saved["scale"], saved["_growth_tracker"]) == (INIT / 2, TRACKER)
    fresh = ShardscalePrecision("16-mixed", growth_interval=100)  # init_scale 2**16
    _, record2 = _fit(
        (HookNet if hooks else Net)(fused=fused),
        STEPS + 2,
        False,
        ckpt_path=str(path),
        plugin=fresh,
        gradient_clip_val=CLIP,
    )
    assert record2.start_state == end_state  # restored exactly before the first step
    assert [r["scale"] for r in record2.rows] == [INIT / 2, INIT / 2]
    assert [r["sched"] for r in record2.rows] == [STEPS, STEPS + 1]
    m = fresh.scaler.metrics()
    assert (m["growth_tracker"], m["steps"], m["skipped_steps"]) == (TRACKER + 2, STEPS + 2, 1)


def test_trainer_bf16_guard(tmp_path: Path) -> None:
    """bf16-mixed: bf16 autocast, the scale stays 1.0, the non-finite step is still skipped."""
    module = Net()
    logger = MemoryLogger()
    trainer, record = _fit(module, STEPS, logger, plugin=ShardscalePrecision("bf16-mixed"))
    assert set(module.out_dtypes) == {torch.bfloat16}
    assert [r["scale"] for r in record.rows] == [1.0] * STEPS
    assert [r["skipped"] for r in record.rows] == SKIPPED
    assert [r["sched"] for r in record.rows] == SCHED
    assert logger.series("skipped_steps")[STEPS - 1] == 1.0
    assert set(logger.series("loss_scale").values()) == {1.0}


def test_monitor_with_lightning_mixed_precision(tmp_path: Path) -> None:
    """LossScaleMonitor with Lightning's own MixedPrecision given a ShardedGradScaler."""
    plugin = MixedPrecision("16-mixed", "cpu", scaler=ShardedGradScaler(**SCALER_KW))
    logger = MemoryLogger()
    trainer, record = _fit(Net(), STEPS, logger, plugin=plugin)
    _check_run(record.rows)
    _check_logged({k: logger.series(k) for k in ("loss_scale", "skipped_steps", "overflows")})
    assert trainer.callbacks[0].held_back_scheduler_steps == 1
    assert "lr_scheduler_step" not in vars(trainer.lightning_module)  # unwrapped at the end


def test_log_every_n_steps(tmp_path: Path) -> None:
    """Values are read and logged only on the Trainer's logging steps."""
    logger = MemoryLogger()
    trainer, _ = _fit(Net(), STEPS, logger, log_every_n_steps=3)
    assert trainer.log_every_n_steps == 3
    assert logger.series("loss_scale") == {2: INIT / 2, 5: INIT / 2}


class ManualNet(Net):
    """Manual optimization: manual_backward, clip_gradients, opt.step(), sch.step() by hand;
    ``opt.zero_grad()`` after the step, or before the backward with ``zero_first``."""

    def __init__(self, zero_first: bool = False, clip: bool = True) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.zero_first, self.clip = zero_first, clip

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt, sch = self.optimizers(), self.lr_schedulers()
        x, y = batch
        if self.zero_first:
            opt.zero_grad()
        self.manual_backward(F.mse_loss(self.net(x).float(), y))  # runs on_after_backward
        if self.clip:
            self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
        opt.step()
        if not self.zero_first:
            opt.zero_grad()
        scaler = self.trainer.precision_plugin.scaler
        if not scaler.last_step_skipped(opt.optimizer):
            sch.step()


def test_trainer_manual_optimization(tmp_path: Path) -> None:
    """manual_backward scales, self.clip_gradients unscales and clips, opt.step() skips."""
    module = ManualNet()
    logger = MemoryLogger()
    _, record = _fit(module, STEPS, logger)
    _check_run(record.rows)
    assert [math.sqrt(a) for a in record.applied] == pytest.approx([CLIP] * (STEPS - 1), rel=1e-4)
    _check_logged({k: logger.series(k) for k in ("loss_scale", "skipped_steps", "overflows")})


class GradFigures(L.Callback):
    """On each batch that stepped, where LossScaleMonitor logs: the headline figures computed by
    hand from the gradients (unscaled in place by the step; the scale the step used is the one
    before its update), by the logger's step."""

    def __init__(self) -> None:
        self.by_step: dict[int, tuple[float, float]] = {}
        self._seen, self._scale = 0, INIT

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == self._seen:
            return  # accumulating
        self._seen = trainer.global_step
        scaler = trainer.precision_plugin.scaler
        used, self._scale = self._scale, scaler.get_scale()
        grads = [_local(p.grad).reshape(-1) for p in pl_module.parameters() if p.grad is not None]
        if not grads:
            return
        g = torch.cat(grads).double().abs()
        top = float(g.max()) * used
        headroom = -top if not math.isfinite(top) else math.log2(65504 / top)
        under = float((g * used < 2.0**-14).double().mean())
        self.by_step[trainer.fit_loop.epoch_loop._batches_that_stepped] = (headroom, under)


def _logged_figures(logger: MemoryLogger, prefix: str = "") -> dict[Any, tuple[float, float]]:
    headroom, under = logger.series(prefix + "headroom_bits"), logger.series(prefix + "underflow")
    assert headroom.keys() == under.keys()
    return {k: (headroom[k], under[k]) for k in headroom}


class TinyGradNet(Net):
    """Net and a parameter whose gradient (1e-12) underflows in fp16 at any scale below 2**26."""

    def __init__(self, fused: bool = False) -> None:
        super().__init__(fused)
        self.tiny = nn.Parameter(torch.ones(4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) + 1e-12 * self.tiny.sum()


TORCH_RULE = {"growth_interval": 100}
#: name: (plugin kwargs, monitor kwargs, Trainer kwargs, fused)
NUMERICS_RUNS: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any], bool]] = {
    "headroom_policy": ({"policy": "headroom"}, {}, {}, False),
    "asked": (TORCH_RULE, {"log_numerics": True, "prefix": "s/"}, {}, False),
    "fused_accumulating": (
        TORCH_RULE,
        {"log_numerics": True},
        {"accumulate_grad_batches": 2},
        True,
    ),
    "headroom_policy_off": ({"policy": "headroom"}, {"log_numerics": False}, {}, False),
    "default_off": (TORCH_RULE, {}, {}, False),
}


@pytest.mark.parametrize("name", NUMERICS_RUNS)
def test_monitor_logs_headroom_and_underflow(name: str) -> None:
    """headroom_bits and underflow go to the loggers on the logged steps, as computed by hand
    from the step's gradients (accumulated ones too); -inf on the overflow step. By default
    only with policy="headroom"."""
    plugin_kw, monitor_kw, trainer_kw, fused = NUMERICS_RUNS[name]
    logger, figures = MemoryLogger(), GradFigures()
    plugin = ShardscalePrecision("16-mixed", init_scale=INIT, **plugin_kw)
    monitor = LossScaleMonitor(**monitor_kw)
    module = TinyGradNet(fused)
    _fit(module, STEPS, logger, plugin=plugin, monitor=monitor, callbacks=(figures,), **trainer_kw)
    logged = _logged_figures(logger, monitor.prefix)
    if name.endswith("_off"):
        assert logged == {} and len(logger.series(monitor.prefix + "loss_scale")) == STEPS
        return
    assert len(logged) == len(figures.by_step) == STEPS
    for step, (headroom, under) in figures.by_step.items():
        if step == INF_STEP:  # the overflow (a skipped fused step leaves them scaled)
            assert logged[step][0] == headroom == -math.inf
        else:
            assert logged[step] == pytest.approx((headroom, under), rel=1e-9)
            assert 0 < headroom < 16
    for step, (_, under) in logged.items():  # tiny's 4 of the 165 elements (inf at step 2)
        assert under == pytest.approx((3 if step == INF_STEP else 4) / 165)


@pytest.mark.parametrize("zero_first", [True, False])
def test_monitor_numerics_in_manual_optimization(zero_first: bool) -> None:
    """Manual optimization: the figures of the gradients training_step leaves; none when it
    set them to None after the step."""
    logger, figures = MemoryLogger(), GradFigures()
    monitor = LossScaleMonitor(log_numerics=True)
    module = ManualNet(zero_first=zero_first, clip=False)
    _fit(module, STEPS, logger, monitor=monitor, callbacks=(figures,))
    logged = _logged_figures(logger)
    if not zero_first:
        assert logged == {} and figures.by_step == {}
        return
    assert len(logged) == STEPS
    for step, (headroom, under) in figures.by_step.items():
        if step != INF_STEP:
            assert logged[step] == pytest.approx((headroom, under), rel=1e-9)


def test_monitor_without_a_shardscale_scaler(tmp_path: Path) -> None:
    """fp32 training: LossScaleMonitor warns and leaves everything as Lightning does."""
    logger = MemoryLogger()
    monitor = LossScaleMonitor()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=3,
        callbacks=[monitor],
        logger=logger,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with pytest.warns(UserWarning, match="no shardscale ShardedGradScaler"):
        trainer.fit(Net(), _loader())
    assert logger.series("loss_scale") == {}
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 3


def test_fabric_single_process(tmp_path: Path) -> None:
    """Fabric: fp16 autocast, fabric.backward scales, fabric.clip_gradients unscales first,
    optimizer.step skips the poisoned step; fabric.save/load round-trips the scaler."""
    plugin = ShardscalePrecision("16-mixed", **SCALER_KW)
    rows = _fabric_loop(L.Fabric(accelerator="cpu", devices=1, plugins=[plugin]), tmp_path)
    assert [r[0] for r in rows] == SCALES
    assert [r[1] for r in rows] == SKIPPED
    clipped = [math.sqrt(r[2]) for i, r in enumerate(rows) if not SKIPPED[i]]
    assert clipped == pytest.approx([CLIP] * (STEPS - 1), rel=1e-4)


def _fabric_loop(fabric: L.Fabric, tmp_path: Path | None) -> list[tuple[float, bool, float]]:
    """STEPS steps; per step: the scale, whether it was skipped, and the local sum of squares
    of the gradients after ``fabric.clip_gradients`` (unscaled, then clipped). ``tmp_path``:
    save and load the scaler through ``fabric.save``/``fabric.load``."""
    fabric.launch()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    dtypes: set[torch.dtype] = set()
    net[0].register_forward_hook(lambda mod, args, out: dtypes.add(out.dtype))
    model = fabric.setup_module(net)
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    scaler = fabric.strategy.precision.scaler
    rows = []
    for step, (x, y) in enumerate(fabric.setup_dataloaders(_loader())):
        if step == STEPS:
            break
        out = model(x)
        assert out.dtype == torch.float32  # convert_output
        fabric.backward(F.mse_loss(out, y))
        if step == INF_STEP and fabric.global_rank == fabric.world_size - 1:
            _local(next(model.parameters()).grad).view(-1)[0] = float("inf")
        fabric.clip_gradients(model, opt, max_norm=CLIP, error_if_nonfinite=False)
        clipped = _grad_sumsq(model.parameters())
        before = [_local(p).detach().clone() for p in model.parameters()]
        opt.step()  # the scaler's step and update
        opt.zero_grad()
        after = [_local(p) for p in model.parameters()]
        moved = any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
        assert moved != SKIPPED[step]
        rows.append((scaler.get_scale(), bool(scaler.last_step_skipped(opt.optimizer)), clipped))
    assert dtypes == {torch.float16}  # computed in fp16 (autocast)
    if tmp_path is not None:
        path = tmp_path / "fabric.ckpt"
        fabric.save(path, {"model": model, "optimizer": opt, "scaler": scaler})
        other = ShardedGradScaler()
        fabric.load(path, {"scaler": other})
        assert other.state_dict() == scaler.state_dict()
        assert (other.get_scale(), other._get_growth_tracker()) == (INIT / 2, TRACKER)
    return rows


# ------------------------------------------------------------------ 2 ranks
class _CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy, unchanged: Lightning refuses ``type(s) is FSDPStrategy`` with
    ``accelerator="cpu"``, a subclass runs its code on the CPU (FSDP1 works there with gloo).
    Used with ``state_dict_type="sharded"``: the default "full" checkpoint gathers with
    ``offload_to_cpu=True``, which crashes rank 0 (SIGSEGV) when FSDP1 runs on the CPU (torch
    2.13)."""


def _fsdp2(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    return fully_shard(model, mesh=mesh["data_parallel"], mp_policy=mp)


#: name: (a new strategy, fused, the model's wrapping in configure_model, HookNet, resume)
RUNS: dict[str, tuple[Any, bool, str | None, bool, bool]] = {
    "ddp": (lambda: "ddp", False, None, False, True),
    "ddp_fused": (lambda: "ddp", True, None, False, True),
    "ddp_hooks": (lambda: "ddp", True, None, True, False),
    "fsdp1": (lambda: _CPUFSDPStrategy(state_dict_type="sharded"), False, "fsdp1", False, True),
    "fsdp1_hooks": (lambda: _CPUFSDPStrategy(), True, "fsdp1", True, False),
    "fsdp2": (lambda: ModelParallelStrategy(2, 1), True, "fsdp2", False, True),
    "fsdp2_hooks": (lambda: ModelParallelStrategy(2, 1), False, "fsdp2", True, False),
}


def _two_ranks(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    out: dict[str, Any] = {}
    for name, (make, fused, wrap, hooks, resume) in RUNS.items():
        logger = MemoryLogger()
        module = (HookNet if hooks else Net)(fused, inf_rank=1, wrap=wrap)
        fit = {"strategy": make(), "devices": 2, "gradient_clip_val": CLIP}
        trainer, record = _fit(module, STEPS, logger, **fit)
        plugin = trainer.precision_plugin
        assert isinstance(plugin, ShardscalePrecision) and trainer.world_size == 2
        out[name] = res = {
            "rows": record.rows,
            "applied": record.applied,
            "logged": {k: logger.series(k) for k in ("loss_scale", "skipped_steps", "overflows")},
            "hook_norms": getattr(module, "hook_norms", None),
            "scaled_norms": module.scaled_norms,
        }
        if resume:
            res["end_state"] = plugin.scaler.state_dict()
            path = os.path.join(tmp, f"{name}.ckpt")
            trainer.save_checkpoint(path)
            fresh = ShardscalePrecision("16-mixed", growth_interval=100)
            fit["strategy"] = make()
            _, record2 = _fit(Net(fused, 1, wrap), STEPS + 2, False, path, plugin=fresh, **fit)
            res["start_state"] = record2.start_state
            res["resumed_scales"] = [r["scale"] for r in record2.rows]
            res["resumed_metrics"] = fresh.scaler.metrics()
    plugin = ShardscalePrecision("16-mixed", **SCALER_KW)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[plugin])
    out["fabric_ddp"] = _fabric_loop(fabric, Path(tmp))
    plugin = ShardscalePrecision("16-mixed", **SCALER_KW)
    strategy = FabricModelParallel(_fsdp2, data_parallel_size=2, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin])
    out["fabric_fsdp2"] = _fabric_loop(fabric, None)
    return out


def test_two_ranks(tmp_path: Path) -> None:
    """On 2 gloo ranks, an inf on rank 1 only: DDP (fused and not), FSDP1 and FSDP2
    (ModelParallelStrategy) in the Trainer, DDP and FSDP2 in Fabric. Both ranks skip the step
    and halve the scale; DDP replicas stay identical; the clip bounds the global norm (hooks
    that read gradients see them unscaled); the values are logged on every rank; a Lightning
    checkpoint resumes the scaler exactly."""
    results = run_ranks(_two_ranks, tmp_path, str(tmp_path), timeout=60)
    for name, (_, fused, wrap, hooks, resume) in RUNS.items():
        per_rank = [r[name] for r in results]
        for res in per_rank:
            _check_run(res["rows"])
            _check_logged(res["logged"])
            if hooks:  # on_before_optimizer_step: unscaled local gradients
                for i in range(STEPS):
                    scale = INIT if i <= INF_STEP else INIT / 2
                    unscaled = res["scaled_norms"][i] / scale
                    if i != INF_STEP:
                        assert res["hook_norms"][i] == pytest.approx(unscaled, rel=1e-5), name
            if resume:
                assert res["start_state"] == res["end_state"], name
                end = res["end_state"]
                assert (end["scale"], end["_growth_tracker"]) == (INIT / 2, TRACKER)
                assert res["resumed_scales"] == [INIT / 2, INIT / 2]
                m = res["resumed_metrics"]
                assert (m["growth_tracker"], m["steps"], m["skipped_steps"]) == (TRACKER + 2, 8, 1)
        # a fused optimizer's step is called on the skipped step too (it skips in its kernel)
        applied = [
            [a for i, a in enumerate(res["applied"]) if not (fused and i == INF_STEP)]
            for res in per_rank
        ]
        if wrap:  # local shards: the global norm sums both ranks
            norms = [math.sqrt(a + b) for a, b in zip(*applied, strict=True)]
        else:  # replicas: each rank holds the whole gradient
            assert applied[0] == pytest.approx(applied[1], rel=1e-6)
            norms = [math.sqrt(a) for a in applied[0]]
            for a, b in zip(per_rank[0]["rows"], per_rank[1]["rows"], strict=True):
                assert torch.equal(a["params"], b["params"])  # identical replicas
        assert norms == pytest.approx([CLIP] * (STEPS - 1), rel=1e-4), name
    for name in ("fabric_ddp", "fabric_fsdp2"):
        per_rank = [r[name] for r in results]
        for rows in per_rank:
            assert [r[0] for r in rows] == SCALES, name
            assert [r[1] for r in rows] == SKIPPED, name
        sumsq = [[r[2] for r in rows] for rows in per_rank]
        if name == "fabric_ddp":
            norms = [math.sqrt(a) for a in sumsq[0]]
        else:
            norms = [math.sqrt(a + b) for a, b in zip(*sumsq, strict=True)]
        clean = [n for i, n in enumerate(norms) if not SKIPPED[i]]
        assert clean == pytest.approx([CLIP] * (STEPS - 1), rel=1e-4), name


# ------------------------------------------------------------------ LightningCLI
class CLIModel(Net):
    def __init__(self, fused: bool = False) -> None:
        super().__init__(fused=fused)


class CLIData(L.LightningDataModule):
    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return _loader()


def test_lightning_cli_yaml(tmp_path: Path) -> None:
    """trainer.plugins / trainer.callbacks as class_path/init_args in a YAML config."""
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        f"""\
trainer:
  accelerator: cpu
  max_steps: {STEPS}
  log_every_n_steps: 1
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args:
      save_dir: {tmp_path}
  plugins:
    - class_path: shardscale.integrations.lightning.ShardscalePrecision
      init_args:
        precision: 16-mixed
        init_scale: 1024
        growth_interval: 100
        hysteresis: 1
  callbacks:
    - class_path: shardscale.integrations.lightning.LossScaleMonitor
      init_args:
        prefix: "amp/"
"""
    )
    cli = LightningCLI(
        CLIModel, CLIData, args=["fit", "--config", str(config)], save_config_callback=None
    )
    plugin = cli.trainer.precision_plugin
    assert isinstance(plugin, ShardscalePrecision)
    assert plugin.scaler.config.growth_interval == 100
    monitor = next(c for c in cli.trainer.callbacks if isinstance(c, LossScaleMonitor))
    assert monitor.prefix == "amp/" and monitor.held_back_scheduler_steps == 1
    assert plugin.scaler.get_scale() == INIT / 2  # ran: the inf step backed off
    cli.trainer.logger.save()
    text = Path(cli.trainer.logger.log_dir, "metrics.csv").read_text()
    assert "amp/loss_scale" in text.splitlines()[0]


@pytest.mark.parametrize("key, ok", [("hysteresis", True), ("hysteresys", False)])
def test_cli_checks_scaler_arguments(tmp_path: Path, key: str, ok: bool) -> None:
    """The scaler's keyword arguments are known to the parser: a misspelt one is refused."""
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        f"""\
trainer:
  logger: false
  plugins:
    - class_path: shardscale.integrations.lightning.ShardscalePrecision
      init_args:
        {key}: 3
"""
    )
    args = ["--config", str(config)]
    if ok:
        cli = LightningCLI(CLIModel, CLIData, args=args, run=False)
        assert cli.trainer.precision_plugin.scaler.config.hysteresis == 3
    else:
        with pytest.raises(SystemExit):
            LightningCLI(CLIModel, CLIData, args=args, run=False)


# ------------------------------------------------------------------ construction and small parts
def test_import_shardscale_does_not_import_lightning() -> None:
    code = "import sys, shardscale, shardscale.integrations; assert 'lightning' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_arguments() -> None:
    p = ShardscalePrecision("16-mixed", init_scale=2**10, growth_interval=100, hysteresis=2)
    assert p.precision == "16-mixed" and p.scaler.get_scale() == 2**10
    assert (p.scaler.config.growth_interval, p.scaler.config.hysteresis) == (100, 2)
    g = ShardscalePrecision("bf16-mixed", max_consecutive_skips=5)
    assert g.scaler.get_scale() == 1.0 and not g.scaler.config.dynamic
    assert g.scaler.config.max_consecutive_skips == 5
    mine = ShardedGradScaler(init_scale=8.0)
    assert ShardscalePrecision(scaler=mine).scaler is mine
    with pytest.raises(ValueError, match="precision must be one of"):
        ShardscalePrecision("16-true")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not both"):
        ShardscalePrecision(scaler=mine, init_scale=2.0)
    with pytest.raises(TypeError, match="ShardedGradScaler"):
        ShardscalePrecision(scaler=torch.amp.GradScaler("cpu"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="growth_factor"):
        ShardscalePrecision(growth_factor=0.5)
    with pytest.raises(TypeError, match="log_numerics must be a bool or None"):
        LossScaleMonitor(log_numerics=1)  # type: ignore[arg-type]


def test_accepted_by_every_strategy() -> None:
    """FSDPStrategy (Trainer and Fabric) only take an FSDPPrecision; the plugin is one."""
    from lightning.fabric.strategies import FSDPStrategy as FabricFSDP
    from lightning.fabric.strategies import ModelParallelStrategy as FabricMP

    p = ShardscalePrecision("16-mixed")
    assert FSDPStrategy(precision_plugin=p).precision_plugin is p
    assert FabricFSDP(precision=p).precision is p
    fabric_mp = FabricMP(parallelize_fn=lambda m, mesh: m)
    fabric_mp.precision = p
    assert fabric_mp.precision is p
    assert FSDPStrategy(precision_plugin=p).mixed_precision_config == p.mixed_precision_config
    mp = p.mixed_precision_config
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.float16, torch.float32)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ModelParallelStrategy(),
        plugins=[p],
        logger=False,
    )
    assert trainer.precision_plugin is p  # Lightning refuses precision="16-mixed" here


def test_loads_a_torch_scaler_checkpoint() -> None:
    """A checkpoint written with Lightning's MixedPrecision (torch's GradScaler state)."""
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=7)
    p = ShardscalePrecision("16-mixed")
    p.on_load_checkpoint({"MixedPrecision": torch_scaler.state_dict()})
    assert p.scaler.get_scale() == 256.0 and p.scaler.get_growth_interval() == 7


def test_cpu_fp16_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sl, "_cpu_fp16_warned", False)
    p = ShardscalePrecision("16-mixed", device="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with p.forward_context():
                assert torch.get_autocast_dtype("cpu") == torch.float16
        with ShardscalePrecision("bf16-mixed", device="cpu").forward_context():
            pass
    assert [str(w.message)[:40] for w in caught] == ["ShardscalePrecision('16-mixed') on the C"]
