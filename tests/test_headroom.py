"""``policy="headroom"``: the rule (a hand-computed sequence), training from small and large
initial scales, overflows, checkpoints, 2 ranks with different amaxes, the costs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks
from test_costs import HostReads

from shardscale import ShardedGradScaler
from shardscale._config import ScalerConfig
from shardscale._headroom import FP16_MAX, HeadroomState, next_state
from shardscale._policy import ScaleState

INF = float("inf")


def _state(scale: float, history: int = 3, hysteresis: int = 1) -> tuple[ScaleState, HeadroomState]:
    return (
        ScaleState.create(torch.device("cpu"), scale, 0, hysteresis, (0,) * 6),
        HeadroomState.create(torch.device("cpu"), history, (), 0),
    )


def _run_rule(config, scale, steps, world=1, measured=False):
    """``steps``: (found_inf, scaled amax) pairs; the scales after each update."""
    state, rule = _state(scale, config.headroom_history, config.hysteresis)
    out = []
    for found, amax in steps:
        found, amax = torch.tensor(float(found)), torch.tensor(float(amax))
        state, rule, _ = next_state(state, rule, found, amax, config, world, measured)
        out.append(state.scale.item())
    return out, state, rule


def test_the_rule_by_hand():
    config = ScalerConfig(policy="headroom", headroom_history=3)
    pseudo = lambda e: FP16_MAX * 2.0 ** -(e + 3) * 1.0001  # noqa: E731
    assert math.floor(math.log2(FP16_MAX / pseudo(8)) - 3) == 7
    steps = [
        (0, 10.0),  # u=10: floor(log2(6550.4) - 3) = 9: straight up from 2**0
        (0, 512 * 20.0),  # u=20: 8: backs off before an overflow
        (1, INF),  # overflow at 2**8: 2**7, pseudo entry (target 7) pushed
        (1, INF),  # second in a row: 2 bits, 2**5; pseudo(7) pushed (target 6), 10 evicted
        (0, 32.0),  # u=1, but max(hist) = pseudo(7): 2**6; 20 evicted
        (0, 64.0),  # u=1: pseudo(8) evicted, pseudo(7) left: 2**6
        (0, 64.0),  # hist [1, 1, 1]: floor(log2(65504) - 3) = 12
        (0, -1.0),  # not measured: the target of the history, unchanged
    ]
    scales, state, rule = _run_rule(config, 1.0, steps)
    assert scales == [2.0**9, 2.0**8, 2.0**7, 2.0**5, 2.0**6, 2.0**6, 2.0**12, 2.0**12]
    assert rule.history.tolist() == [1.0, 1.0, 1.0] and int(rule.backoffs) == 0
    # counters: steps, skipped, consecutive, overflows, backoffs, growths
    assert state.counters.tolist() == [8, 2, 0, 2, 3, 3]


def test_the_rule_margin_grows_with_the_ranks_and_an_empty_history_keeps_the_scale():
    config = ScalerConfig(policy="headroom")
    assert _run_rule(config, 2.0**5, [(0, -1.0), (0, 0.0)])[0] == [2.0**5, 2.0**5]
    one = _run_rule(config, 1.0, [(0, 10.0)], world=1)[0]
    four = _run_rule(config, 1.0, [(0, 10.0)], world=4)[0]
    assert one == [2.0**9] and four == [2.0**7]  # margin 3 + log2(4)
    wide = ScalerConfig(policy="headroom", headroom_margin=0.0, max_scale=2.0**11)
    assert _run_rule(wide, 1.0, [(0, 1e-3)])[0] == [2.0**11]  # bounded by max_scale


def test_the_rule_from_a_scale_not_a_power_of_two_and_with_all_zero_gradients():
    config = ScalerConfig(policy="headroom", headroom_history=2)
    # an overflow at 1000: the pseudo entry's target, the largest power of two below 1000;
    # the second in a row: 2 bits down
    assert _run_rule(config, 1000.0, [(1, INF), (1, INF)])[0] == [512.0, 128.0]
    # measured all-zero gradients push empty slots: the history empties, the scale stays
    scales, _, rule = _run_rule(config, 1.0, [(0, 10.0), (0, 0.0), (0, 0.0)], measured=True)
    assert scales == [2.0**9] * 3 and rule.history.tolist() == [0.0, 0.0]


def test_the_rule_with_hysteresis_and_the_floor_and_the_collapse_guard():
    config = ScalerConfig(policy="headroom", hysteresis=2)
    scales, _, rule = _run_rule(config, 2.0**10, [(1, INF), (1, INF), (1, INF)])
    assert scales == [2.0**10, 2.0**9, 2.0**7]  # absorbed, then 1 and 2 bits
    assert int(rule.backoffs) == 2
    config = ScalerConfig(policy="headroom")
    state, rule = _state(2.0)
    for expected, collapsed in ((1.0, False), (1.0, True)):
        state, rule, c = next_state(state, rule, torch.tensor(1.0), torch.tensor(INF), config)
        assert state.scale.item() == expected and bool(c) is collapsed  # floor: max(min_scale, 1)


# ------------------------------------------------------------------------------- training
class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _loss(net: torch.nn.Module, step: int) -> torch.Tensor:
    """The fp32 loss of ``net`` in fp16 autocast on batch ``step`` (fixed random data)."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)
    with torch.autocast("cpu", dtype=torch.float16):
        logits = net(x)
    return F.cross_entropy(logits.float(), y)


def _train(scaler, steps, fused=False, inf_at=(), seed=0, net=None, opt=None, start=0):
    """fp16-autocast training on fixed random batches; returns per-step (log2 scale used,
    skipped, unscaled amax of the weight gradients)."""
    torch.manual_seed(seed)
    net = net if net is not None else Net()
    opt = opt if opt is not None else torch.optim.AdamW(net.parameters(), lr=1e-2, fused=fused)
    out = []
    for step in range(start, start + steps):
        loss = _loss(net, step)
        scale = scaler.get_scale()
        opt.zero_grad()
        scaler.scale(loss).backward()
        if step in inf_at:
            net.a.weight.grad.view(-1)[0] = INF
        amax = max(p.grad.abs().max().item() for p in net.parameters()) / scale
        scaler.step(opt)
        scaler.update()
        skipped = getattr(scaler, "last_step_skipped", lambda: False)()
        out.append((math.log2(scale), bool(skipped), amax))
    return out, net, opt


def _target(amax: float, margin: float = 3.0) -> int:
    return math.floor(math.log2(FP16_MAX / amax) - margin)


@pytest.mark.parametrize("fused", [False, True])
def test_from_one_the_scale_jumps_to_the_measured_target_without_a_skip(fused):
    scaler = ShardedGradScaler("cpu", init_scale=1.0, policy="headroom", headroom_history=4)
    rows, _, _ = _train(scaler, 8, fused)
    assert not any(skipped for _, skipped, _ in rows)
    assert rows[1][0] >= 10  # one clean step is enough
    for i in range(1, len(rows)):  # each scale: the target of the last 4 amaxes measured
        peak = max(a for _, _, a in rows[max(0, i - 4) : i])
        assert rows[i][0] == _target(peak), (i, rows)


@pytest.mark.parametrize("fused", [False, True])
def test_from_2_24_it_backs_off_then_jumps_to_the_target(fused):
    scaler = ShardedGradScaler("cpu", init_scale=2.0**24, policy="headroom")
    rows, _, _ = _train(scaler, 10, fused)
    skipped = [i for i, (_, s, _) in enumerate(rows) if s]
    assert skipped and skipped == list(range(len(skipped)))  # the first steps only
    first_clean = len(skipped)
    e_last_overflow = rows[first_clean - 1][0]
    used = rows[first_clean + 1][0]
    assert used == min(_target(rows[first_clean][2]), e_last_overflow - 1)
    assert used >= 10


def test_an_overflow_backs_off_and_the_scale_stays_below_it():
    scaler = ShardedGradScaler("cpu", init_scale=1.0, policy="headroom", headroom_history=5)
    rows, _, _ = _train(scaler, 11, inf_at=(3, 4))
    e = [r[0] for r in rows]
    assert [r[1] for r in rows] == [False] * 3 + [True, True] + [False] * 6
    assert e[4] == e[3] - 1 and e[5] == e[4] - 2  # x0.5, then x0.25
    # the pseudo entries: below the overflowing scales while they are remembered (5 steps)
    assert e[9] == min(e[4] - 1, _target(max(r[2] for r in rows[5:9])))
    assert e[10] == _target(max(r[2] for r in rows[5:10]))  # then the measured amaxes alone


def test_a_step_read_clean_on_the_host_updates_as_the_device_rule_does():
    """SGD's step reads its flag on the host; a clean one lets update() leave the overflow's
    branches out. Fused SGD's step reads nothing (the whole rule on the device). Both give the
    same scales, history, counters and parameters (a power-of-two scale unscales exactly
    either way), through overflows in a row and all-zero gradients."""
    out = []
    for fused in (False, True):
        torch.manual_seed(0)
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=1e-3, fused=fused)
        scaler = ShardedGradScaler("cpu", init_scale=2.0**20, policy="headroom", headroom_history=3)
        scales = []
        for step, factor in enumerate([1, 1e3, 1, 0, 0, 0, 0, 1e-3, 1, 1e4, 1, 1, 1]):
            opt.zero_grad()
            scaler.scale(_loss(net, step) * factor).backward()
            if step == 8:
                net.a.weight.grad.view(-1)[0] = INF
            scaler.step(opt)
            scaler.update()
            scales.append(math.log2(scaler.get_scale()))
        out.append((scales, scaler.state_dict(), [p.detach().clone() for p in net.parameters()]))
    (scales, sd, params), (scales_f, sd_f, params_f) = out
    # backs off from 2**20 (2 skips); all-zero gradients empty the history (the scale stays);
    # tiny gradients: up; an inf, then larger gradients: 3 backoffs in a row (1, 2, 4 bits)
    assert scales == [19, 17, 16, 16, 16, 16, 16, 26, 25, 23, 19, 16, 16] == scales_f
    assert sd == sd_f and sd["_counters"]["skipped_steps"] == 5
    assert all(torch.equal(p, q) for p, q in zip(params, params_f, strict=True))


def test_measure_every_k_non_fused_steps():
    scaler = ShardedGradScaler("cpu", init_scale=1.0, policy="headroom", measure_every=3)
    _train(scaler, 7)
    assert len(scaler.state_dict()["_headroom_history"]) == 3  # steps 0, 3, 6


def test_the_default_policy_keeps_torchs_sequence():
    ours = ShardedGradScaler("cpu", init_scale=2.0**20, growth_interval=3)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)
    a = [r[0] for r in _train(ours, 8)[0]]
    b = [r[0] for r in _train(theirs, 8)[0]]
    assert a == b and ours.state_dict()["_headroom_history"] == []


@pytest.mark.parametrize("fused,every", [(False, 1), (True, 1), (False, 4)])
def test_state_dict_round_trip_resumes_bit_identically(fused, every):
    """measure_every's phase comes from the checkpoint's steps counter: a resume after 6
    updates measures at updates 8 and 12 as the uninterrupted run does."""
    kw = dict(init_scale=2.0**20, policy="headroom", headroom_history=6, measure_every=every)
    uninterrupted = ShardedGradScaler("cpu", **kw)
    full, net_full, _ = _train(uninterrupted, 12, fused, inf_at=(7,))
    first = ShardedGradScaler("cpu", **kw)
    head, net, opt = _train(first, 6, fused, inf_at=(7,))
    saved = first.state_dict()
    assert saved["policy"] == "headroom" and saved["measure_every"] == every
    assert len(saved["_headroom_history"]) == (6 if every == 1 else 2)
    second = ShardedGradScaler("cpu")  # policy comes from the checkpoint
    second.load_state_dict(saved)
    tail, net, _ = _train(second, 6, fused, inf_at=(7,), net=net, opt=opt, start=6)
    assert head + tail == full and second.state_dict() == uninterrupted.state_dict()
    for p, q in zip(net.parameters(), net_full.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_torch_checkpoint_starts_an_empty_history():
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    ours = ShardedGradScaler("cpu", policy="headroom")
    ours.load_state_dict(theirs.state_dict())
    sd = ours.state_dict()
    assert sd["policy"] == "headroom" and sd["_headroom_history"] == [] and sd["scale"] == 2.0**12
    with pytest.raises(ValueError, match="_headroom_history"):
        ours.load_state_dict({**sd, "_headroom_history": [1.0, -2.0]})
    assert ours.state_dict() == sd


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="policy"):
        ShardedGradScaler("cpu", policy="fast")
    with pytest.raises(ValueError, match="headroom_margin"):
        ShardedGradScaler("cpu", policy="headroom", headroom_margin=-1.0)
    with pytest.raises(ValueError, match="headroom_history"):
        ShardedGradScaler("cpu", policy="headroom", headroom_history=0)
    with pytest.raises(TypeError, match="measure_every"):
        ShardedGradScaler("cpu", policy="headroom", measure_every=1.5)
    with pytest.raises(ValueError, match="dynamic=False"):
        ShardedGradScaler("cpu", policy="headroom", dynamic=False)
    with pytest.raises(ValueError, match="dynamic=False"):
        ShardedGradScaler.guard(policy="headroom")
    with pytest.warns(UserWarning, match="does not use growth_factor, growth_interval"):
        ShardedGradScaler("cpu", policy="headroom", growth_factor=3.0, growth_interval=100)


def test_a_checkpoint_that_changes_the_policy_says_so():
    saved = ShardedGradScaler("cpu", policy="headroom")
    _train(saved, 2)
    plain = ShardedGradScaler("cpu")  # the default policy: taken from the checkpoint
    with pytest.warns(UserWarning, match="policy='headroom' replaces this scaler's 'torch'"):
        plain.load_state_dict(saved.state_dict())
    assert plain.config.policy == "headroom"
    kept = ShardedGradScaler("cpu", policy="torch")  # named: kept over the checkpoint's
    with pytest.warns(UserWarning, match=r"keeps the policy.*policy='torch'"):
        kept.load_state_dict(saved.state_dict())
    assert kept.config.policy == "torch" and kept.get_scale() == saved.get_scale()


def test_no_scale_below_the_floor_of_1_enters():
    with pytest.raises(ValueError, match=r"init_scale=0.5 lies below policy='headroom''s floor"):
        ShardedGradScaler("cpu", init_scale=0.5, policy="headroom")
    scaler = ShardedGradScaler("cpu", policy="headroom")
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler.scale(_loss(net, 0)).backward()
    scaler.step(opt)
    with pytest.raises(
        ValueError, match=r"floor 1 \(.*max\(min_scale, 1\), here 1\).*changed nothing"
    ):
        scaler.update(0.3)
    scaler.update(3.0)  # a scale that is not a power of two is allowed
    assert scaler.get_scale() == 3.0
    # a torch checkpoint below 1 is clamped to the floor, and says so
    theirs = torch.amp.GradScaler("cpu", init_scale=0.25)
    with pytest.warns(UserWarning, match=r"scale'\]=0.25 .*loaded as 1.0"):
        scaler.load_state_dict(theirs.state_dict())
    assert scaler.get_scale() == 1.0


def test_a_collapse_at_the_floor_names_the_floor():
    from shardscale import ScaleCollapseError

    scaler = ShardedGradScaler("cpu", init_scale=4.0, policy="headroom")
    with pytest.raises(ScaleCollapseError, match=r"sits at its floor 1 \(policy='headroom'"):
        _train(scaler, 6, inf_at=range(6))


@pytest.mark.parametrize("min_scale,floor", [(3.0, 4), (1000.0, 1024)])
def test_a_min_scale_not_a_power_of_two_collapses_at_the_power_above_it(min_scale, floor):
    """The rule's scales are powers of two: its backoffs stop at the power of two above
    min_scale, and an overflow there is a collapse (not skipped steps forever)."""
    from shardscale import ScaleCollapseError

    scaler = ShardedGradScaler("cpu", init_scale=2.0**16, policy="headroom", min_scale=min_scale)
    with pytest.raises(ScaleCollapseError, match=rf"sits at its floor {floor} \(policy='headroom'"):
        _train(scaler, 30, inf_at=range(30))
    assert scaler.get_scale() == floor


def test_no_scale_between_a_min_scale_not_a_power_of_two_and_the_floor_enters():
    """min_scale=3: the floor is 4. A scale of 3 would be "backed off" up to 4 by the first
    overflow (and called a collapse): init_scale, update(new_scale) and a loaded scale below
    4 are refused, a torch checkpoint's clamped to 4; 5 (above the floor) backs off to 4."""
    with pytest.raises(ValueError, match=r"init_scale=3.0 lies below .*floor 4 \(.*here 3\).*>= 4"):
        ShardedGradScaler("cpu", init_scale=3.0, policy="headroom", min_scale=3.0)
    assert ShardedGradScaler("cpu", policy="headroom", min_scale=1e5).get_scale() == 2.0**17
    scaler = ShardedGradScaler("cpu", init_scale=5.0, policy="headroom", min_scale=3.0)
    _train(scaler, 1, inf_at=[0])
    assert scaler.get_scale() == 4.0 and scaler.metrics()["backoffs"] == 1
    scaler.scale(_loss(Net(), 0))
    scaler.abandon()
    with pytest.raises(ValueError, match=r"new_scale=3.5 lies below .*floor 4"):
        scaler.update(3.5)
    theirs = torch.amp.GradScaler("cpu", init_scale=3.0)
    with pytest.warns(UserWarning, match=r"scale'\]=3.0 .*loaded as 4.0"):
        scaler.load_state_dict(theirs.state_dict())
    assert scaler.get_scale() == 4.0


@pytest.mark.parametrize("bounds", [(5.0, 7.0), (3.0, 3.0), (1.0, 0.5)])
def test_bounds_holding_no_power_of_two_above_the_floor_are_refused(bounds):
    """policy='headroom' sets powers of two: with none in [max(min_scale, 1), max_scale] its
    backoffs would stop short of the floor and the collapse guard never fire."""
    lo, hi = bounds
    with pytest.raises(ValueError, match=r"hold no power of two .*widen max_scale to \d+"):
        ShardedGradScaler("cpu", policy="headroom", min_scale=min(lo, hi), max_scale=hi)
    ShardedGradScaler("cpu", min_scale=min(lo, hi), max_scale=hi)  # torch's rule: fine
    state = ShardedGradScaler("cpu", policy="headroom").state_dict()
    state.update(min_scale=min(lo, hi), max_scale=hi, scale=hi)
    with pytest.raises(ValueError, match=r"state_dict\['min_scale'\] and max_scale"):
        ShardedGradScaler("cpu", policy="headroom").load_state_dict(state)


def test_clip_after_update_without_scale_warns_as_step_does():
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu")
    scaler.scale(_loss(net, 0)).backward()
    scaler.step(opt)
    scaler.update()
    with pytest.warns(RuntimeWarning, match="after update\\(\\) with no scale\\(\\) since"):
        scaler.clip_grad_norm_(opt, 1.0)


def test_fused_steps_read_the_host_only_to_poll_the_alarm():
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)
    scaler = ShardedGradScaler("cpu", init_scale=1.0, policy="headroom")
    reads = HostReads()
    reads.not_in(opt)
    x = torch.randn(8, 16)
    counts = []
    for _ in range(20):
        opt.zero_grad()
        loss = net(x).pow(2).mean()
        reads.count = 0
        with reads:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        counts.append(reads.count)
    assert counts == [int((i + 1) % 16 == 0) for i in range(20)]
    assert scaler.get_scale() > 2.0**10


# ------------------------------------------------------------------------------- clipping
def _train_clipped(scaler, steps, fused, ours: bool):
    """:func:`_train`'s batches with a clip of max_norm 0.5: ``scaler.clip_grad_norm_`` (ours)
    or torch's recipe (``unscale_`` then ``torch.nn.utils.clip_grad_norm_``); the log2 scales."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=fused)
    scales = []
    for step in range(steps):
        loss = _loss(net, step)
        scales.append(math.log2(scaler.get_scale()))
        opt.zero_grad()
        scaler.scale(loss).backward()
        if ours:
            scaler.clip_grad_norm_(opt, 0.5)
        else:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
    params = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    return scales, params


@pytest.mark.parametrize("fused", [False, True])
def test_a_clipped_iteration_is_measured_as_an_unscaled_one(fused):
    """The clip's read measures the amax: the same scales as unscale_ and torch's clip."""
    kw = dict(init_scale=1.0, policy="headroom", headroom_history=4)
    ours, p_ours = _train_clipped(ShardedGradScaler("cpu", **kw), 8, fused, ours=True)
    theirs, p_theirs = _train_clipped(ShardedGradScaler("cpu", **kw), 8, fused, ours=False)
    assert ours == theirs and ours[1] >= 10  # from 2**0 straight to the target
    torch.testing.assert_close(p_ours, p_theirs)


def _two_ranks_clipped(rank: int, world_size: int, norm_type: float) -> dict:
    """Pipeline-style: rank r holds and steps only layer r (rank_local_params), clipped by
    the scaler over both ranks; different amaxes per rank."""
    torch.manual_seed(0)
    net = Net()
    owned = [net.a, net.b][rank]
    opt = torch.optim.AdamW(owned.parameters(), lr=1e-2)
    scaler = ShardedGradScaler("cpu", init_scale=1.0, policy="headroom", rank_local_params=True)
    scales, amaxes = [], []
    for step in range(4):
        loss = _loss(net, step)
        net.zero_grad()
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        amaxes.append(max(p.grad.abs().max().item() for p in owned.parameters()))  # scaled
        scaler.clip_grad_norm_(opt, 0.5, norm_type)
        scaler.step(opt)
        scaler.update()
        scales.append(scale)
    return {"scales": scales, "amaxes": amaxes}


@pytest.mark.parametrize("norm_type", [2.0, INF])
def test_two_ranks_measure_in_the_clips_all_reduce(tmp_path, norm_type):
    """p=2: the clip's SUM carries the amax's exponent (its power-of-two upper bound); p=inf:
    its MAX carries the amax itself. Both ranks take the same scale from it."""
    r0, r1 = run_ranks(_two_ranks_clipped, tmp_path, norm_type)
    assert r0["scales"] == r1["scales"]
    peak = max(r0["amaxes"][0], r1["amaxes"][0])  # scale 1: scaled = unscaled
    assert r0["amaxes"][0] != r1["amaxes"][0]
    agreed = peak if math.isinf(norm_type) else 2.0 ** math.frexp(peak)[1]
    assert agreed >= peak and math.log2(r0["scales"][1]) == _target(agreed, 4.0)


# ------------------------------------------------------------------------------- 2 ranks
def _two_ranks(rank: int, world_size: int, fused: bool) -> dict:
    """ZeRO-style: both ranks compute the same full gradients; rank r steps only layer r
    (different amaxes per rank), then each layer is broadcast from its owner."""
    import torch.distributed as dist

    torch.manual_seed(0)
    net = Net()
    owned = [net.a, net.b][rank]
    opt = torch.optim.AdamW(owned.parameters(), lr=1e-2, fused=fused)
    scaler = ShardedGradScaler("cpu", init_scale=1.0, policy="headroom")
    scales, amaxes = [], []
    for step in range(8):
        loss = _loss(net, step)
        opt.zero_grad()
        net.zero_grad()
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        if step == 5 and rank == 1:
            net.b.weight.grad.view(-1)[0] = INF  # one rank overflows: both skip
        amaxes.append(max(p.grad.abs().max().item() for p in owned.parameters()) / scale)
        scaler.step(opt)
        scaler.update()
        scales.append(scale)
        for src, layer in enumerate([net.a, net.b]):
            for p in layer.parameters():
                dist.broadcast(p.data, src)
    params = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    return {"scales": scales, "amaxes": amaxes, "params": params, "skipped": scaler.metrics()}


@pytest.mark.parametrize("fused", [False, True])
def test_two_ranks_with_different_amaxes_agree_on_the_scale(tmp_path, fused):
    r0, r1 = run_ranks(_two_ranks, tmp_path, fused)
    assert r0["scales"] == r1["scales"]
    assert torch.equal(r0["params"], r1["params"])
    assert r0["amaxes"][0] != r1["amaxes"][0]
    assert r0["skipped"]["skipped_steps"] == r1["skipped"]["skipped_steps"] == 1
    # the scale after step 0: the group's amax with margin 3 + log2(2)
    peak = max(r0["amaxes"][0], r1["amaxes"][0])
    assert math.log2(r0["scales"][1]) == _target(peak, 4.0)
    assert r0["scales"][6] < r0["scales"][5]  # the skipped step 5 backed off on both


def _uneven(rank: int, world_size: int, fused: bool) -> dict:
    """Join: rank 1 runs out of data after 3 batches; rank 0 goes on, overflows at batch 4 and
    has all-zero gradients at batch 5 (the joined rank pushes the same empty slot)."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    scaler = ShardedGradScaler("cpu", init_scale=1.0, policy="headroom")
    scales = []
    with Join([model, scaler]):
        for i in range(6 if rank == 0 else 3):
            opt.zero_grad()
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + i))
            factor = {4: INF, 5: 0.0}.get(i, 1.0) if rank == 0 else 1.0
            loss = model(x).pow(2).mean() * factor
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
    return {"scales": scales, "final": scaler.get_scale(), "sd": scaler.state_dict()}


@pytest.mark.parametrize("fused", [False, True])
def test_join_keeps_the_ranks_on_one_scale(tmp_path, fused):
    r0, r1 = run_ranks(_uneven, tmp_path, fused, timeout=30)
    assert r1["scales"] == r0["scales"][:3] and r0["scales"][0] > 2.0**10
    assert r0["scales"][4] < r0["scales"][3]  # rank 0's overflow backed off on both
    assert r0["final"] == r1["final"] and r0["sd"] == r1["sd"]


def test_update_compiles_with_fullgraph_and_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = ShardedGradScaler("cpu", init_scale=1.0, policy="headroom")
    eager = ShardedGradScaler("cpu", init_scale=1.0, policy="headroom")
    update = torch.compile(compiled.update, fullgraph=True)
    for i in range(3):
        for scaler, step in ((compiled, update), (eager, eager.update)):
            opt.zero_grad()
            scaler.scale(model(torch.ones(3, 4) * (i + 1)).sum()).backward()
            scaler.unscale_(opt)
            step()
        assert compiled.state_dict() == eager.state_dict()
    assert compiled.get_scale() > 2.0**8


def test_the_other_policys_arguments_warn_that_they_are_unused():
    with pytest.warns(UserWarning, match="policy='torch' does not use headroom_margin"):
        ShardedGradScaler("cpu", policy="torch", headroom_margin=5.0)
    scaler = ShardedGradScaler("cpu", policy="headroom")
    with pytest.warns(UserWarning, match=r"set_growth_factor\(\): policy='headroom' does not use"):
        scaler.set_growth_factor(3.0)
    assert scaler.get_growth_factor() == 3.0  # stored, as torch's setter stores it
