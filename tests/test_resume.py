"""Checkpoint and resume: the scaler's state survives save/load bit for bit.

Distributed part (2 gloo ranks, DDP and FSDP2 ``fully_shard``): launch A trains ``N_STEPS`` steps
uninterrupted, injecting overflows on one rank before and after the checkpoints, and saves
(model, optimizer, scaler) at ``SAVE_AT`` steps with ``torch.distributed.checkpoint`` (the scaler
passed as a ``Stateful``) and with ``torch.save``. Launch B (fresh processes) builds a fresh
model, optimizer and a *default-constructed* scaler, restores each checkpoint and continues: the
scale, growth/hysteresis trackers, counters, skip decisions and parameters must equal launch A's
bit for bit.

Single-process part: saving at every point of an iteration (before the first ``scale()``, after
``scale``, ``unscale_``, ``step``, ``update``), ``torch.load(weights_only=True)``, DCP without a
process group, pickle/deepcopy, and loading a ``scale=1024, _growth_tracker=1`` state through each
path (torch's known wrapper bug turns it into 2048/0).
"""

from __future__ import annotations

import copy
import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist import run_ranks
from _oracle import PyScaleState, reference_step
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from shardscale import ScalerConfig, ShardedGradScaler

N_STEPS = 9
SAVE_AT = (3, 6)
# step -> (rank, how): overflows before and after each checkpoint.
INJECT = {0: (1, "grad_inf"), 1: (0, "nan_loss"), 5: (1, "grad_nan"), 8: (0, "grad_inf")}
CFG = {"init_scale": 2048.0, "hysteresis": 2, "growth_interval": 3}
MODES = ("ddp", "fsdp2")


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _wrap(mode: str, model: torch.nn.Module) -> torch.nn.Module:
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    fully_shard(model[0])
    fully_shard(model)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _params(model: torch.nn.Module) -> list[list[float]]:
    return [_local(p.detach()).double().flatten().tolist() for p in model.parameters()]


def _train_step(model, opt, scaler, step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(6, 4, generator=g)
    y = torch.randn(6, 2, generator=g)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    who, how = INJECT.get(step, (-1, ""))
    if who == rank and how == "nan_loss":
        loss = loss * float("nan")
    scaler.scale(loss).backward()
    if who == rank and how.startswith("grad_"):
        grad = _local(next(iter(model.parameters())).grad)
        grad.view(-1)[0] = float("inf") if how == "grad_inf" else float("nan")
    scaler.step(opt)
    scaler.update()
    out = scaler.metrics()
    out["skipped"] = bool(scaler.last_step_skipped(opt))
    return out


def _fresh(mode: str, seed: int):
    torch.manual_seed(seed)
    model = _wrap(mode, _model())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def _save(mode: str, model, opt, scaler, ckpt: str, k: int, rank: int) -> None:
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "scaler": scaler}, checkpoint_id=f"{ckpt}/{mode}_dcp_{k}")
    if mode == "ddp":
        path = f"{ckpt}/{mode}_pt_{k}_rank{rank}.pt"
        torch.save({"model": msd, "optim": osd, "scaler": scaler.state_dict()}, path)
    else:  # FSDP2: full (unsharded) state dicts, written by rank 0, read by every rank
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        fmsd, fosd = get_state_dict(model, opt, options=opts)
        if rank == 0:
            torch.save(
                {"model": fmsd, "optim": fosd, "scaler": scaler.state_dict()},
                f"{ckpt}/{mode}_pt_{k}.pt",
            )
        dist.barrier()


def _restore(mode: str, fmt: str, model, opt, scaler, ckpt: str, k: int, rank: int) -> dict:
    if fmt == "dcp":
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "scaler": scaler}
        dcp.load(state, checkpoint_id=f"{ckpt}/{mode}_dcp_{k}")
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        return scaler.state_dict()
    name = f"{mode}_pt_{k}_rank{rank}.pt" if mode == "ddp" else f"{mode}_pt_{k}.pt"
    saved = torch.load(os.path.join(ckpt, name), weights_only=True)
    opts = StateDictOptions(full_state_dict=(mode == "fsdp2"))
    set_state_dict(
        model, opt, model_state_dict=saved["model"], optim_state_dict=saved["optim"], options=opts
    )
    scaler.load_state_dict(saved["scaler"])
    return saved["scaler"]


def _uninterrupted(rank: int, world_size: int, ckpt: str) -> dict:
    out = {}
    for mode in MODES:
        model, opt = _fresh(mode, seed=0)
        scaler = ShardedGradScaler("cpu", **CFG)
        traj, saved = [], {}
        for step in range(N_STEPS):
            traj.append(_train_step(model, opt, scaler, step, rank))
            if step + 1 in SAVE_AT:
                saved[step + 1] = scaler.state_dict()
                _save(mode, model, opt, scaler, ckpt, step + 1, rank)
        out[mode] = {"traj": traj, "saved": saved, "params": _params(model)}
    return out


def _resumed(rank: int, world_size: int, ckpt: str) -> dict:
    out = {}
    for mode in MODES:
        for fmt in ("dcp", "pt"):
            for k in SAVE_AT:
                model, opt = _fresh(mode, seed=1234)  # different init: the load must matter
                scaler = ShardedGradScaler("cpu")  # defaults: the config comes from the checkpoint
                loaded = _restore(mode, fmt, model, opt, scaler, ckpt, k, rank)
                after_load = scaler.state_dict()
                traj = [_train_step(model, opt, scaler, s, rank) for s in range(k, N_STEPS)]
                out[(mode, fmt, k)] = {
                    "loaded": loaded,
                    "after_load": after_load,
                    "traj": traj,
                    "params": _params(model),
                }
    return out


def _expected_scales() -> list[tuple[float, int, int]]:
    cfg = ScalerConfig(hysteresis=2, growth_interval=3)
    st = PyScaleState(2048.0, 0, 2)
    out = []
    for step in range(N_STEPS):
        st, _ = reference_step(st, int(step in INJECT), cfg)
        out.append((st.scale, st.growth_tracker, st.hysteresis_tracker))
    return out


@pytest.mark.dist
def test_resume_ddp_fsdp2_dcp_and_torch_save_bit_for_bit(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    ref = run_ranks(_uninterrupted, tmp_path, ckpt)
    res = run_ranks(_resumed, tmp_path, ckpt)  # fresh processes

    expected = _expected_scales()
    # hand check of the interesting save points: scale 1024 with growth tracker 1 at step 3,
    # hysteresis tracker 1 (one overflow absorbed) at step 6.
    assert expected[2] == (1024.0, 1, 0)
    assert expected[5] == (2048.0, 0, 1)
    for rank in range(2):
        for mode in MODES:
            traj = ref[rank][mode]["traj"]
            got = [(m["scale"], m["growth_tracker"], m["hysteresis_tracker"]) for m in traj]
            assert got == expected, (rank, mode)
            assert [m["skipped"] for m in traj] == [s in INJECT for s in range(N_STEPS)]
            assert traj == ref[0][mode]["traj"]  # ranks agree
            saved = ref[rank][mode]["saved"]
            assert saved[3]["scale"] == 1024.0 and saved[3]["_growth_tracker"] == 1
            assert saved[6]["_hysteresis_tracker"] == 1
            for fmt in ("dcp", "pt"):
                for k in SAVE_AT:
                    r = res[rank][(mode, fmt, k)]
                    assert r["loaded"] == saved[k], (rank, mode, fmt, k)
                    assert r["after_load"] == saved[k], (rank, mode, fmt, k)
                    assert r["traj"] == traj[k:], (rank, mode, fmt, k)
                    assert r["params"] == ref[rank][mode]["params"], (rank, mode, fmt, k)
    # DDP parameters are replicated: equal across ranks.
    assert ref[0]["ddp"]["params"] == ref[1]["ddp"]["params"]


# ----------------------------------------------------------------- single process


def _tiny(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _iteration(model, opt, scaler, step: int, stop: str | None = None) -> None:
    """One iteration; overflow on steps 1 and 2; return early after ``stop``."""
    x = torch.full((4, 3), 0.1 * (step + 1))
    loss = model(x).square().mean()
    if step in (1, 2):
        loss = loss * float("inf")
    opt.zero_grad()
    scaled = scaler.scale(loss)
    if stop == "scale":
        return
    scaled.backward()
    scaler.unscale_(opt)
    if stop == "unscale_":
        return
    scaler.step(opt)
    if stop == "step":
        return
    scaler.update()


def _stage(scaler: ShardedGradScaler) -> dict:
    return {
        k: (v["stage"], not v["found_inf_per_device"])
        for k, v in scaler._per_optimizer_states.items()
    }


@pytest.mark.parametrize("point", ["never_scaled", "scale", "unscale_", "step", "update"])
def test_save_at_any_point_of_the_iteration(point, tmp_path):
    kw = {"init_scale": 4096.0, "hysteresis": 2, "growth_interval": 2}
    model, opt = _tiny()
    scaler = ShardedGradScaler("cpu", **kw)
    for step in range(3):  # 2 overflows: scale 2048, hysteresis tracker 0
        _iteration(model, opt, scaler, step)
    boundary = scaler.state_dict()
    assert (boundary["scale"], boundary["_growth_tracker"]) == (2048.0, 0)
    if point == "never_scaled":
        scaler = ShardedGradScaler("cpu", **kw)
        scaler.load_state_dict(boundary)
    else:
        _iteration(model, opt, scaler, 3, stop=None if point == "update" else point)
    sd = scaler.state_dict()  # saving works at every point
    if point != "update":
        assert sd == boundary  # mid-iteration: the state before this iteration's update
    else:
        assert (sd["scale"], sd["_growth_tracker"]) == (2048.0, 1)
    path = tmp_path / "s.pt"
    torch.save(sd, path)
    loaded = torch.load(path, weights_only=True)
    assert loaded == sd
    fresh = ShardedGradScaler("cpu")
    fresh.load_state_dict(loaded)
    assert fresh.state_dict() == sd
    if point in ("unscale_", "step"):  # mid-iteration: restoring or pickling is refused
        before, stage = scaler.state_dict(), _stage(scaler)
        with pytest.raises(RuntimeError, match="iteration boundary"):
            scaler.load_state_dict(loaded)
        with pytest.raises(RuntimeError, match="beginning of an iteration"):
            pickle.dumps(scaler)
        with pytest.raises(RuntimeError, match="beginning of an iteration"):
            copy.deepcopy(scaler)
        assert scaler.state_dict() == before and _stage(scaler) == stage
    else:  # at a boundary: the same scaler reloads
        if point == "scale":  # the loss is scaled by the scale in force: abandoned
            with pytest.warns(RuntimeWarning, match=r"after scale\(\).*abandoned"):
                scaler.load_state_dict(loaded)
        scaler.load_state_dict(loaded)
        assert scaler.state_dict() == sd
        clone = pickle.loads(pickle.dumps(scaler))
        assert clone.state_dict() == sd and copy.deepcopy(scaler).state_dict() == sd


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_resume_continues_like_uninterrupted_single_process(tmp_path):
    """Save after every update, resume in a new scaler (torch.save, pickle, deepcopy, DCP)."""
    kw = {"init_scale": 4096.0, "hysteresis": 2, "growth_interval": 2}
    model, opt = _tiny()
    ref = ShardedGradScaler("cpu", **kw)
    ref_traj = []
    for step in range(8):
        _iteration(model, opt, ref, step)
        ref_traj.append(ref.metrics())
    ref_params = [p.detach().clone() for p in model.parameters()]
    for how in ("torch.save", "pickle", "deepcopy", "dcp"):
        for k in (1, 2, 4):
            model, opt = _tiny()
            scaler = ShardedGradScaler("cpu", **kw)
            for step in range(k):
                _iteration(model, opt, scaler, step)
            sd = scaler.state_dict()
            msd = copy.deepcopy(model.state_dict())
            if how == "torch.save":
                torch.save(sd, tmp_path / "s.pt")
                new = ShardedGradScaler("cpu")
                new.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
            elif how == "pickle":
                new = pickle.loads(pickle.dumps(scaler))
            elif how == "deepcopy":
                new = copy.deepcopy(scaler)
            else:
                cid = str(tmp_path / f"dcp_{k}")
                dcp.save({"scaler": scaler}, checkpoint_id=cid, no_dist=True)
                new = ShardedGradScaler("cpu")
                dcp.load({"scaler": new}, checkpoint_id=cid, no_dist=True)
            assert new.state_dict() == sd, (how, k)
            model2, opt2 = _tiny(seed=5)
            model2.load_state_dict(msd)
            traj = []
            for step in range(k, 8):
                _iteration(model2, opt2, new, step)
                traj.append(new.metrics())
            assert traj == ref_traj[k:], (how, k)
            for p, q in zip(model2.parameters(), ref_params, strict=True):
                assert torch.equal(p, q), (how, k)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("path", ["load_fresh", "load_initialized", "pickle", "dcp", "torch_sd"])
def test_restore_never_changes_scale_or_tracker(path, tmp_path):
    """scale 1024 with growth tracker 1 stays 1024/1 (torch's wrapper bug gives 2048/0)."""
    src = ShardedGradScaler("cpu", init_scale=1024.0, growth_interval=2)
    src.load_state_dict({**src.state_dict(), "_growth_tracker": 1})
    sd = src.state_dict()
    assert (sd["scale"], sd["_growth_tracker"]) == (1024.0, 1)
    new = ShardedGradScaler("cpu")
    if path == "load_fresh":
        new.load_state_dict(sd)
    elif path == "load_initialized":
        new.place("cpu")  # the scale tensor exists already (65536)
        new.load_state_dict(sd)
    elif path == "pickle":
        new = pickle.loads(pickle.dumps(src))
    elif path == "dcp":
        dcp.save({"scaler": src}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
        dcp.load({"scaler": new}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    else:  # a torch.amp.GradScaler checkpoint with the same numbers
        ts = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
        tsd = ts.state_dict()
        tsd["_growth_tracker"] = 1
        new.load_state_dict(tsd)
    m = new.metrics()
    assert (m["scale"], m["growth_tracker"]) == (1024.0, 1)
    new.scale(torch.tensor(1.0))  # lazy init keeps the loaded values
    m = new.metrics()
    assert (m["scale"], m["growth_tracker"]) == (1024.0, 1)
    # one clean step then grows exactly as the uninterrupted scaler would (interval 2)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    new.scale(p.sum()).backward()
    new.step(opt)
    new.update()
    assert (new.get_scale(), new.metrics()["growth_tracker"]) == (2048.0, 0)


@pytest.mark.parametrize(
    "value, expected", [(3e38, 2.0**127), (1e-40, 2.0**-126), (0.0, 2.0**-126)]
)
def test_torch_state_outside_the_bounds_loads_clamped_with_a_warning(value, expected):
    """torch's GradScaler has no bounds (growth 1.7 passes 2**127; backoffs go below 2**-126):
    such a valid torch state loads, clamped into this scaler's bounds, with a warning."""
    sd = {"scale": value, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}
    sd["_growth_tracker"] = 3
    s = ShardedGradScaler("cpu")
    with pytest.warns(UserWarning, match="torch.amp.GradScaler state"):
        s.load_state_dict(sd)
    assert s.get_scale() == expected and s.state_dict()["_growth_tracker"] == 3


def test_a_guard_asked_for_survives_an_older_checkpoint():
    """A checkpoint written without a guard (or by torch's scaler) does not switch off the guard
    the constructor asked for: asked fields are kept (warned when the checkpoint differs), the
    state comes from the checkpoint; fields left at their defaults take the checkpoint's."""
    old = ShardedGradScaler("cpu", init_scale=256.0, hysteresis=2)
    old.scale(torch.ones(()))
    sd = old.state_dict()  # max_consecutive_skips=None, on_collapse="raise", hysteresis=2
    s = ShardedGradScaler("cpu", max_consecutive_skips=3, on_collapse="warn", min_scale=1.0)
    with pytest.warns(
        UserWarning, match=r"keeps the policy the constructor asked for.*max_consecutive_skips=3"
    ):
        s.load_state_dict(sd)
    cfg = s.config
    assert (cfg.max_consecutive_skips, cfg.on_collapse, cfg.min_scale) == (3, "warn", 1.0)
    assert cfg.hysteresis == 2  # not asked for: the checkpoint's
    assert s.get_scale() == 256.0 and s.state_dict()["_hysteresis_tracker"] == 2
    # from torch's scaler: its keys only, the guard stays
    t = torch.amp.GradScaler("cpu", init_scale=0.5)
    t.scale(torch.ones(()))
    s = ShardedGradScaler("cpu", max_consecutive_skips=3, min_scale=1.0)
    with pytest.warns(UserWarning, match="outside"):
        s.load_state_dict(t.state_dict())  # 0.5 lies below the kept min_scale
    assert s.config.max_consecutive_skips == 3 and s.get_scale() == 1.0
    # a malformed checkpoint is refused even in a field kept
    bad = {**sd, "max_consecutive_skips": 0}
    before = s.state_dict()
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        s.load_state_dict(bad)
    assert s.state_dict() == before
