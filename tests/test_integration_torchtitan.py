"""shardscale.integrations.torchtitan: torchtitan 0.3.0's llama3 debug model (2 layers) trained in
fp16 on the CPU on 2 gloo ranks, through torchtitan's own command line and loop
(``--module shardscale.integrations.torchtitan --config _titan:tiny``, ``trainer.train()``).

One launch of torch's elastic launcher (2 ranks) runs every scenario in turn (:func:`worker_main`)
and writes what each rank saw; the tests check it:

* the gradient check: with the chunked loss, the gradients of the first backward are exactly
  S times the unscaled run's (fp32 parameters, so that S = 1024 is exact), the textbook
  ``(loss * S).backward()`` on the returned loss scales nothing, and the logged loss, the
  gradient norm and the parameters after the step are those of the unscaled run;
* FSDP2 (2-way sharding), fp16: an inf in one gradient on rank 1 at one step: both ranks skip,
  the scale halves on both, parameters identical across ranks and unchanged by the skipped step,
  the LR held; ``loss_scale``/``skipped_steps`` in torchtitan's metrics; a DCP checkpoint, and
  a resumed run bit-identical to the uninterrupted one;
* FSDP2 x TP (2-way TP), fp16, hysteresis 2: the same agreement;
* a checkpoint saved by plain torchtitan (no scaler state) loads into the fp16 trainer, which
  then trains exactly as the plain run did;
* the configuration: ``--config MODULE:CONFIG``, ``--loss_scaling.*`` options, errors.

The CPU scaffolding torchtitan needs is in ``tests/_titan.py``. Skipped when torchtitan is not
installed (``pip install 'shardscale[torchtitan]'``).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (shardscale[torchtitan])")

LAUNCH_TIMEOUT_S = 240
SCALE = 1024.0
SHARDSCALE = "--module shardscale.integrations.torchtitan --config _titan:tiny"
PLAIN = "--module _titan --config tiny"
#: fp32 parameters, 2 microbatches per step on 2 data-parallel ranks (2 sequences each)
#: docs/torchtitan.md's command line (after ``torchrun ... -m torchtitan.train``)
README_ARGS = (
    "--module shardscale.integrations.torchtitan --config llama3:llama3_debugmodel "
    "--loss_scaling.init_scale 1024 --loss_scaling.hysteresis 2"
)
FP32_ACCUMULATE = "--training.mixed_precision_param float32 --training.global_batch_size 8"


# --------------------------------------------------------------------- every rank (worker)
def _args(*parts: str) -> list[str]:
    """torchtitan's command line from space-separated parts (paths without spaces)."""
    return [word for part in parts for word in part.split()]


def _build(*parts: str) -> Any:
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(_args(*parts)).build()


def _one_step(trainer: Any, iterator: Any) -> None:
    """One step of torchtitan's loop (``train()`` without its checkpoint load and end)."""
    trainer.step += 1
    trainer.train_step(iterator)


def _summary(trainer: Any) -> dict[str, Any]:
    return {
        "records": trainer.records,
        "logged": trainer.list_logger.logged,
        "class": type(trainer).__name__,
    }


def _grad_check(out: Path) -> dict[str, Any]:
    """One step each (2 microbatches), fp32 parameters: plain torchtitan, shardscale (S = 1024),
    and the textbook recipe on the returned loss. The plain trainer saves a checkpoint after its
    step (for the ``old_checkpoint`` scenario), then takes a second step."""
    import torch

    plain = _build(
        PLAIN,
        FP32_ACCUMULATE,
        "--checkpoint.enable --checkpoint.interval 1",
        f"--dump_folder {out / 'plain'}",
    )
    iterator = plain.batch_generator(plain.dataloader)
    _one_step(plain, iterator)
    plain.checkpointer.save(plain.step)
    _one_step(plain, iterator)
    scaled = _build(
        SHARDSCALE,
        FP32_ACCUMULATE,
        f"--loss_scaling.init_scale {SCALE}",
        f"--dump_folder {out / 'scaled'}",
    )
    _one_step(scaled, scaled.batch_generator(scaled.dataloader))
    textbook = _build(
        PLAIN, FP32_ACCUMULATE, f"--textbook_scale {SCALE}", f"--dump_folder {out / 'textbook'}"
    )
    _one_step(textbook, textbook.batch_generator(textbook.dataloader))
    g_plain, g_scaled, g_textbook = plain.first_grads, scaled.first_grads, textbook.first_grads
    result = {
        "class": type(scaled).__name__,
        "accumulation": scaled.gradient_accumulation_steps,
        "loss_fn": type(scaled.loss_fn).__name__,
        "inner_loss_fn": type(scaled.loss_fn.loss_fn).__name__,
        "grads_nonzero": int((g_plain != 0).sum()),
        "scaled_is_S_times": bool(torch.equal(g_scaled, g_plain * SCALE)),
        "scaled_max_rel_err": float((g_scaled / SCALE - g_plain).abs().max() / g_plain.abs().max()),
        "textbook_is_unscaled": bool(torch.equal(g_textbook, g_plain)),
        "plain": _summary(plain),
        "scaled": _summary(scaled),
    }
    for trainer in (plain, scaled, textbook):
        trainer.close()
    return result


def _train(*parts: str) -> dict[str, Any]:
    trainer = _build(*parts)
    fresh = trainer.scaler.metrics()
    trainer.train()
    out = {**_summary(trainer), "fresh": fresh, "final": trainer.scaler.metrics()}
    trainer.close()
    return out


def _config_checks() -> dict[str, Any]:
    """Configuration only (no process group used): the command line, to_fp16, errors."""
    import dataclasses

    from torchtitan.config import ConfigManager
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    import shardscale.integrations.torchtitan as tt

    out: dict[str, Any] = {}
    config = ConfigManager().parse_args(_args(README_ARGS, "--training.steps 3"))
    out["readme"] = {
        "class": type(config).__qualname__,
        "owner": config._owner.__name__,
        "param_dtype": config.training.mixed_precision_param,
        "loss_scaling": config.loss_scaling.scaler_kwargs(),
        "steps": config.training.steps,
        "loss": type(config.loss).__qualname__,
    }
    again = tt.to_fp16(config, growth_interval=7)
    out["again"] = {
        "same_class": type(again) is type(config),
        "loss_scaling": again.loss_scaling.scaler_kwargs(),
        "model_spec_shared": again.model_spec is config.model_spec,
    }
    errors: dict[str, str] = {}

    def expect(name: str, fn: Any) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the message is the result
            errors[name] = f"{type(exc).__name__}: {exc}"
        else:
            errors[name] = "no error"

    expect("bad_backoff", lambda: tt.LossScalingConfig(backoff_factor=2.0))
    expect("bad_type", lambda: tt.to_fp16(dataclasses.replace(config.training)))
    expect("no_colon", lambda: tt.llama3_debugmodel)
    expect("no_module", lambda: getattr(tt, "no_such_module:cfg"))
    expect("no_config", lambda: getattr(tt, "llama3:no_such_config"))
    pp = tt.to_fp16(llama3_debugmodel())
    pp.parallelism.pipeline_parallel_degree = 2
    pp.training.disable_cuda_graphs = True
    expect("pipeline", lambda: tt.ShardscaleTrainer(pp))
    out["errors"] = errors
    return out


class _Captured(logging.Handler):
    """torchtitan's log lines (its logger is the root logger) that mention the scaler."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "loss_scale" in message:  # the metrics line, the old-checkpoint warning
            self.messages.append(message)


def worker_main(config_path: str) -> None:
    """Entry point of each rank under ``torch.distributed.run``: every scenario, in one process
    group; writes ``rank{r}.pkl``."""
    import _titan

    _titan.install_cpu_scaffolding()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(json.loads(Path(config_path).read_text())["out"])
    rank = int(os.environ["RANK"])
    from torchtitan.tools.logging import init_logger

    init_logger()  # as torchtitan's main() does: INFO on the root logger
    captured = _Captured()
    logging.getLogger().addHandler(captured)
    results: dict[str, Any] = {"seconds": {}}

    def phase(name: str, fn: Any, *args: Any) -> Any:
        start = time.perf_counter()
        captured.messages.clear()
        results[name] = fn(*args)
        results[name]["log_lines"] = list(captured.messages)
        results["seconds"][name] = time.perf_counter() - start

    if rank == 0:
        phase("config", _config_checks)
    phase("grad_check", _grad_check, out / "grad")
    fsdp = (
        SHARDSCALE,
        f"--loss_scaling.init_scale {SCALE} --loss_scaling.growth_interval 2 --inf_steps 3",
        "--training.steps 6 --checkpoint.enable --checkpoint.interval 4",
        f"--dump_folder {out / 'fsdp'}",
    )
    phase("fsdp", _train, *fsdp)
    phase("resumed", _train, *fsdp, "--checkpoint.load_step 4 --checkpoint.load_only")
    tp = (
        SHARDSCALE,
        f"--loss_scaling.init_scale {SCALE} --loss_scaling.hysteresis 2 --inf_steps 2 3",
        "--parallelism.tensor_parallel_degree 2 --parallelism.data_parallel_shard_degree 1",
        f"--training.steps 4 --dump_folder {out / 'tp'}",
    )
    phase("tp", _train, *tp)
    old = (  # the plain run's checkpoint of _grad_check
        SHARDSCALE,
        FP32_ACCUMULATE,
        "--loss_scaling.init_scale 512 --training.steps 2 --checkpoint.enable",
        f"--checkpoint.load_only --dump_folder {out / 'grad' / 'plain'}",
    )
    phase("old_checkpoint", _train, *old)
    (out / f"rank{rank}.pkl").write_bytes(pickle.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # after DCP checkpoints torch's teardown at exit can abort on a loaded machine


def launch(tmp_path: Path, nproc: int = 2) -> list[dict[str, Any]]:
    """Run :func:`worker_main` on ``nproc`` ranks under torch's elastic launcher."""
    import _titan

    assets = tmp_path / "assets"
    _titan.write_assets(str(assets))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"out": str(tmp_path)}))
    here = str(Path(__file__).parent)
    script = tmp_path / "worker.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {here!r})
            from test_integration_torchtitan import worker_main
            worker_main({str(config)!r})
            """
        )
    )
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]),
        "TITAN_ASSETS": str(assets),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "hf_datasets"),
        "HF_HOME": str(tmp_path / "hf_home"),
        "WANDB_MODE": "disabled",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, f"{proc.stdout[-8000:]}\n{proc.stderr[-8000:]}"
    return [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(nproc)]


# ------------------------------------------------------------------------- checks (pytest)
@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch(tmp_path_factory.mktemp("titan"))


def _logged(run: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {entry["step"]: entry for entry in run["logged"]}


def _check_agreement(
    ranks: list[dict[str, Any]], name: str, scales: list[float], skipped: set[int]
) -> None:
    """Every rank: the expected scale after each step and skip set; replicas identical;
    skipped steps leave parameters and LR as they were."""
    for res in ranks:
        run = res[name]
        assert run["class"] == "ShardscaleRecordingTrainer"
        records = run["records"]
        assert [r["step"] for r in records] == list(range(1, len(scales) + 1))
        for i, rec in enumerate(records):
            step, m = rec["step"], rec["scaler"]
            assert m["scale"] == scales[i], (name, step, m)
            assert m["last_step_skipped"] == (step in skipped), (name, step, m)
            assert m["skipped_steps"] == len({s for s in skipped if s <= step})
            assert m["steps"] == step
            if i == 0:
                continue
            prev = records[i - 1]
            if step in skipped:  # the parameters and the LR schedule stay where they were
                assert rec["params"] == prev["params"], (name, step)
                assert rec["last_epoch"] == prev["last_epoch"] and rec["lr"] == prev["lr"]
            else:
                assert rec["params"] != prev["params"], (name, step)
                assert rec["last_epoch"] == prev["last_epoch"] + 1
    for step in range(len(scales)):  # replicas: the same parameters and scaler on every rank
        ref = ranks[0][name]["records"][step]
        for res in ranks[1:]:
            rec = res[name]["records"][step]
            assert rec["params"] == ref["params"] and rec["scaler"] == ref["scaler"]
            assert rec["lr"] == ref["lr"]


def test_chunked_loss_gradients_are_scaled(ranks):
    for res in ranks:
        g = res["grad_check"]
        assert g["class"] == "ShardscaleRecordingTrainer" and g["accumulation"] == 2
        assert (g["loss_fn"], g["inner_loss_fn"]) == ("ChunkedLossWrapper", "ScaledLoss")
        assert g["grads_nonzero"] > 1000
        assert g["scaled_is_S_times"], g["scaled_max_rel_err"]
        # the trap: backward() of S * (the loss ChunkedLossWrapper returns) scales nothing
        assert g["textbook_is_unscaled"]
        plain, scaled = g["plain"], g["scaled"]
        # the same step (2 microbatches, unscaled once after the second): logged loss (the true
        # one) and grad_norm, then the same parameters
        lp, ls = _logged(plain)[1], _logged(scaled)[1]
        assert ls["loss_metrics/global_avg_loss"] == lp["loss_metrics/global_avg_loss"]
        assert ls["grad_norm"] == lp["grad_norm"]
        assert scaled["records"][0]["params"] == plain["records"][0]["params"]
        assert ls["loss_scale"] == SCALE and ls["skipped_steps"] == 0
        assert "loss_scale" not in lp


def test_fsdp2_inf_on_one_rank_skips_on_both(ranks):
    # init 1024, growth_interval 2, inf at step 3 on rank 1
    scales = [SCALE, 2 * SCALE, SCALE, SCALE, 2 * SCALE, 2 * SCALE]
    _check_agreement(ranks, "fsdp", scales, {3})
    fsdp = ranks[0]["fsdp"]
    assert fsdp["fresh"]["scale"] == SCALE and fsdp["fresh"]["steps"] == 0
    logged = _logged(fsdp)
    assert sorted(logged) == list(range(1, 7))
    for step, entry in logged.items():
        assert entry["loss_scale"] == scales[step - 1]
        assert entry["skipped_steps"] == int(step >= 3)
    assert logged[3]["grad_norm"] == float("inf")  # torchtitan's norm of the unscaled grads
    assert any(
        line.endswith("step:  3  loss_scale: 1024  skipped_steps: 1") for line in fsdp["log_lines"]
    ), fsdp["log_lines"]
    losses = [logged[s]["loss_metrics/global_avg_loss"] for s in range(1, 7)]
    assert all(0 < loss < 10 for loss in losses) and losses[-1] < losses[0]


def test_fsdp2_resume_is_exact(ranks):
    for res in ranks:
        full, resumed = res["fsdp"]["records"], res["resumed"]["records"]
        assert [r["step"] for r in resumed] == [5, 6]
        assert resumed == full[4:]  # scaler state, LR, every parameter bit
        assert res["resumed"]["final"] == res["fsdp"]["final"]
        logged, ref = _logged(res["resumed"]), _logged(res["fsdp"])
        for step in (5, 6):
            for key in ("loss_metrics/global_avg_loss", "grad_norm", "loss_scale"):
                assert logged[step][key] == ref[step][key], (step, key)


def test_fsdp2_tp_inf_on_one_rank_skips_on_both(ranks):
    # hysteresis 2: the first overflow (step 2) is skipped without a backoff, the second halves
    _check_agreement(ranks, "tp", [SCALE, SCALE, SCALE / 2, SCALE / 2], {2, 3})
    logged = _logged(ranks[0]["tp"])
    assert [logged[s]["skipped_steps"] for s in range(1, 5)] == [0, 1, 2, 2]


def test_checkpoint_without_scaler_loads(ranks):
    for res in ranks:
        old, plain = res["old_checkpoint"], res["grad_check"]["plain"]
        assert any("has no 'loss_scaler' state" in w for w in old["log_lines"]), old["log_lines"]
        (rec,) = old["records"]
        assert rec["step"] == 2
        # the plain run's step 2, from its step-1 checkpoint: the same parameters and LR
        ref = plain["records"][1]
        assert rec["params"] == ref["params"] and rec["lr"] == ref["lr"]
        assert rec["scaler"]["scale"] == 512.0 and rec["scaler"]["steps"] == 1


def test_configuration(ranks):
    cfg = ranks[0]["config"]
    readme = cfg["readme"]
    assert readme["class"] == "ShardscaleTrainer.Config" and readme["owner"] == "ShardscaleTrainer"
    assert readme["param_dtype"] == "float16" and readme["steps"] == 3
    assert (
        readme["loss_scaling"]["init_scale"] == 1024 and readme["loss_scaling"]["hysteresis"] == 2
    )
    assert readme["loss"] == "ChunkedLossWrapper.Config"  # torchtitan's own, scaled when built
    again = cfg["again"]
    assert again["same_class"] and again["model_spec_shared"]
    assert again["loss_scaling"]["growth_interval"] == 7
    assert again["loss_scaling"]["init_scale"] == 1024 and again["loss_scaling"]["hysteresis"] == 2
    errors = cfg["errors"]
    assert errors["bad_backoff"].startswith("ValueError: backoff_factor must be in (0, 1)")
    assert errors["bad_type"].startswith("TypeError: to_fp16() takes a torchtitan trainer config")
    assert errors["no_colon"].startswith("AttributeError")
    assert "MODULE:CONFIG" not in errors["no_colon"]
    assert errors["no_module"].startswith("ValueError: --config no_such_module:...")
    assert "Available" in errors["no_config"] and "llama3_debugmodel" in errors["no_config"]
    assert errors["pipeline"].startswith("NotImplementedError") and (
        "--parallelism.pipeline_parallel_degree 1" in errors["pipeline"]
    )


def test_import_shardscale_does_not_import_torchtitan():
    code = (
        "import sys, shardscale, shardscale.integrations\n"
        "assert not any(m.startswith('torchtitan') for m in sys.modules), 'torchtitan imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


_HEADROOM_FIGURES = """
import torch
from _titan import install_cpu_scaffolding

install_cpu_scaffolding()  # torchtitan's optional triton import
from shardscale.integrations.torchtitan import LossScalingConfig, scaler_metrics

for policy, keys in (("torch", set()), ("headroom", {"headroom_bits", "underflow"})):
    scaler = LossScalingConfig(policy=policy, init_scale=1024.0).build(torch.device("cpu"))
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    scaler.scale(model(torch.ones(3, 4)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    figures = scaler_metrics(scaler)
    assert set(figures) - {"loss_scale", "skipped_steps"} == keys, (policy, figures)
    if keys:
        assert 0 < figures["headroom_bits"] < 16 and figures["underflow"] == 0.0, figures
print("ok")
"""


def test_headroom_policy_from_the_command_line_logs_its_figures():
    """``--loss_scaling.policy headroom`` builds a headroom scaler, and the metrics gain the
    last step's headroom bits and underflow fraction (torch's rule: not). In a process of its
    own (torchtitan's CPU scaffolding)."""
    env = {**os.environ, "PYTHONPATH": os.path.dirname(__file__)}
    out = subprocess.run(
        [sys.executable, "-c", _HEADROOM_FIGURES], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
