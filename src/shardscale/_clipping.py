"""``clip_grad_norm_``'s place in the iteration: which gradients a clip reads, what it does to
the record, and which of :mod:`shardscale._clip`'s pure functions it runs.

:class:`Clipping` is a mixin of :class:`shardscale.ShardedGradScaler`:

* **an optimizer, READY**: its gradients are still scaled: one read pass, one all-reduce
  (the norm with the agreed found-inf flag, :func:`_clip.norm_and_clip`), then the write pass
  (or, for a fused optimizer where :func:`_clip.may_fold`, the fold into its ``grad_scale``);
  the optimizer is recorded UNSCALED with the agreed flag, as after ``unscale_``;
* **an optimizer, UNSCALED** (torch's recipe: ``unscale_`` first) or a **disabled** scaler:
  the gradients are clipped as they are (:func:`_clip.clip_unscaled`);
* **parameters**: unscaled and clipped in place and remembered
  (:meth:`~shardscale._iteration.Iteration.clipped_params`): their optimizer's ``step``
  leaves them alone and still skips after an overflow; parameters unscaled already are
  clipped as they are;
* a rank with no ``scale()`` since the scaler was made or loaded learns from the clip's
  all-reduce whether another rank scaled (else its gradients must be zero);
* a joined rank (``Join``) clips no gradients of its own and takes part in the all-reduce.

With ``policy="headroom"`` a clip of scaled gradients measures their amax (one more read
pass on measured steps, :func:`_clip.global_norm`) for the rule, as a check does.

Reads the scaler's ``_it``, ``_calls``, ``_config``, ``_headroom``, ``_enabled``,
``_loss_scale``, ``_bounds``, ``_names``, ``_device``, ``process_group``,
``rank_local_params`` and ``_join_config`` (``Joinable``'s), and calls its ``_begin`` and
``_lazy_init_scale_growth_tracker``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from . import _clip, _grads, _headroom, _join, _sync
from ._iteration import STALE
from ._protocol import is_optimizer, step_kind


class Clipping:
    """The scaler's ``clip_grad_norm_`` orchestration (see the module docstring)."""

    _it: Any
    _calls: Any
    _config: Any
    _headroom: Any
    _enabled: bool
    _loss_scale: Any
    _bounds: Any
    _names: Any
    _device: str
    _join_config: Any
    process_group: Any
    rank_local_params: bool
    _begin: Any
    _lazy_init_scale_growth_tracker: Any

    def _clip_grad_norm(self, target: Any, args: _clip.ClipArgs) -> torch.Tensor:
        """The clip of ``target`` (an optimizer or a list of parameters) with validated
        ``args``: the total norm (0-d float32)."""
        if self._it.carried:  # the first call after a new backward pass
            self._it.settle()
        is_opt = is_optimizer(target)
        params = list(_grads.iter_params(target)) if is_opt else target
        group = _clip.single_group(_sync.resolve_groups(self.process_group))
        buckets = _clip.bucket(params, group, self.rank_local_params, self._names)
        if self._calls.shadowing:
            buckets = {}  # a joined rank: no gradients of this iteration
        elif buckets and self._it.saw_gradients():
            warnings.warn(STALE, RuntimeWarning, stacklevel=3)
        if group is not None:
            _join.check_order(self._join_config)
        if not self._enabled:
            return _clip.clip_unscaled(buckets, args.p, args.max_norm, group, **args.opts)
        if not is_opt:
            self._lazy_init_scale_growth_tracker(params[0].device if params else self._device)
            return self._clip_params(buckets, params, group, args)
        if any(id(q) in self._it.pre_unscaled for q in params):
            raise _clip.refused("optimizer after params")
        state = self._begin("clip_grad_norm_", target)
        if state["stage"] is OptState.UNSCALED:  # after unscale_(): clip them as they are
            return _clip.clip_unscaled(buckets, args.p, args.max_norm, group, **args.opts)
        if state["stage"] is not OptState.READY:
            self._it.failed(target)
            raise _clip.refused("after step")
        fused = step_kind(target) != "plain" and _clip.may_fold(target, args, self._bounds)
        fused = fused and not _grads.unscaled_or_tied(target, ())  # tied: unscaled in place
        try:
            total, state["grad_scale"], found_inf, anyone = self._norm_and_clip(
                buckets, params, group, fused, args
            )
        except BaseException:
            self._it.failed(target)
            raise
        self._it.checked(target, state, found_inf, anyone, unscaled=True)
        return total

    def _norm_and_clip(
        self, buckets: Any, params: list[Any], group: Any, fused: bool, args: _clip.ClipArgs
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """:func:`_clip.norm_and_clip` of scaled gradients: ``(total, grad_scale or None,
        agreed found_inf, whether any rank scaled)``; an idle rank's gradients must be another
        rank's scaled ones, or zero."""
        it, scale = self._it, self._loss_scale.tensors.scale
        inv, low = _grads.inv_scale(scale, self._loss_scale.math), self._bounds.below_one
        idle = buckets and not (it.scaled_here or it.ever_scaled)  # refused before any write
        if idle and group is None:  # on one process: no other rank scaled
            it.scaled_elsewhere(None, params, "clip_grad_norm_")
        probe = None  # policy="headroom": the amax is measured in the clip's read
        if self._config.policy != "torch":
            probe = self._headroom.request(self._config, check_only=False)
        out = _clip.norm_and_clip(
            buckets, scale, inv, args.p, args.max_norm, group, fused, it.vote(), low,
            amax=probe, **args.opts,
        )  # fmt: skip
        if idle and group is not None:  # the clip's all-reduce tells whether another rank did
            it.scaled_elsewhere(out[3], params, "clip_grad_norm_", written=True)
        if probe is not None:
            world = 1 if group is None else group.size()
            self._headroom.note(_headroom.local_amax(probe, scale.device), world)
        return out

    def _clip_params(
        self, buckets: Any, params: list[Any], group: Any, args: _clip.ClipArgs
    ) -> torch.Tensor:
        """``clip_grad_norm_(params)``: unscaled and clipped, remembered with the agreed flag;
        parameters whose gradients are unscaled already are clipped as they are."""
        if _clip.unscaled_already(self._it.stages_of(params), params):
            return _clip.clip_unscaled(buckets, args.p, args.max_norm, group, **args.opts)
        total, _, found_inf, _ = self._norm_and_clip(buckets, params, group, False, args)
        self._it.clipped_params(params, found_inf)
        return total
