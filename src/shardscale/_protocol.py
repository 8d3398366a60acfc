"""torch's private protocol: the ``GradScaler`` internals that frameworks, ``grad_scaler=``
optimizers (apex's fused optimizers) and PyTorch's own tests read and write.

:class:`TorchInternals` is a mixin of :class:`shardscale.ShardedGradScaler`; every attribute
torch's ``GradScaler.__init__`` sets, and every private method those callers use, is here and
tells the truth. It reads the scaler's own state: ``_loss_scale`` (a
:class:`~shardscale._policy.LossScale`), ``_it`` (the :class:`~shardscale._iteration.Iteration`),
``_config``, ``_device``, ``_calls`` (the Join log) and ``_names``.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch

from ._config import warn_unused_setter
from ._grads import (
    SharedMemoryGradError,
    bucket_grads,
    iter_params,
    measure_and_check,
    unscale_and_check,
)


def is_optimizer(obj: object) -> bool:
    """Whether ``obj`` looks like a ``torch.optim.Optimizer`` (param groups and a step)."""
    return hasattr(obj, "param_groups") and callable(getattr(obj, "step", None))


def step_kind(optimizer: Any) -> str:
    """How ``optimizer`` takes the scale (as torch's ``GradScaler.step``): ``"plain"`` (the
    scaler unscales and decides), ``"fused"`` (``_step_supports_amp_scaling``: it gets
    ``grad_scale`` and ``found_inf`` tensors) or ``"grad_scaler"`` (its class's ``step`` takes
    ``grad_scaler=`` and unscales itself through these internals: :func:`takes_grad_scaler`)."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return "plain"
    if torch.compiler.is_compiling():  # a constant of the graph; no branch on the cache, which
        known = takes_grad_scaler(type(optimizer))  # the trace itself fills (a re-trace after
    else:  # a graph break would take the other branch: SpeculationLogDivergence)
        known = _TAKES_GRAD_SCALER.get(type(optimizer))
        if known is None:
            known = takes_grad_scaler(type(optimizer))
    return "grad_scaler" if known else "fused"


#: ``optimizer class -> takes_grad_scaler(class)``
_TAKES_GRAD_SCALER: dict[type, bool] = {}


@torch._dynamo.assume_constant_result  # traced: run once, its answer a constant of the graph
def takes_grad_scaler(cls: type) -> bool:
    """Whether ``cls.step`` is on torch's ``step(closure=None, *, grad_scaler=None)`` protocol,
    read from the class (once per class), not from the bound method: an instance's ``step``
    wrapped by a profiler, or the class's by a decorator without ``functools.wraps`` (pytorch
    #129922), shows ``(*args, **kwargs)``. The ``step`` the class defines (the first in its MRO)
    is looked at, through ``__wrapped__``, ``functools.partial`` and the functions a wrapper
    closes over, for a ``grad_scaler`` parameter."""
    known = _TAKES_GRAD_SCALER.get(cls)
    if known is None:
        known = _TAKES_GRAD_SCALER[cls] = _declares_grad_scaler(cls)
    return known


def _declares_grad_scaler(cls: type) -> bool:
    """:func:`takes_grad_scaler`, uncached."""
    step = next((vars(k)["step"] for k in cls.__mro__ if "step" in vars(k)), None)
    seen: set[int] = set()
    todo = [step] if step is not None else []
    while todo:
        fn = todo.pop()
        fn = getattr(fn, "__func__", fn)  # staticmethod / classmethod
        if id(fn) in seen or not callable(fn):
            continue
        seen.add(id(fn))
        try:
            if "grad_scaler" in inspect.signature(fn, follow_wrapped=False).parameters:
                return True
        except (TypeError, ValueError):  # no signature (a builtin)
            pass
        inner = [getattr(fn, a, None) for a in ("__wrapped__", "func")]  # wraps(), partial
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                inner.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        todo.extend(f for f in inner if inspect.isfunction(f) or inspect.ismethod(f))
    return False


class TorchInternals:
    """torch's ``GradScaler`` private state and methods, on shardscale's state."""

    _loss_scale: Any
    _it: Any
    _config: Any
    _device: str
    _enabled: bool
    _calls: Any
    _names: Any

    # the scale state's tensors (None before the first scale(); created by
    # _lazy_init_scale_growth_tracker)
    @property
    def _scale(self) -> torch.Tensor | None:  # type: ignore[override]
        tensors = self._loss_scale.tensors
        return None if tensors is None else tensors.scale

    @_scale.setter
    def _scale(self, value: torch.Tensor | None) -> None:
        if value is not None:
            self._lazy_init_scale_growth_tracker(value.device)
            self._loss_scale.tensors.scale = value

    @property
    def _growth_tracker(self) -> torch.Tensor | None:  # type: ignore[override]
        tensors = self._loss_scale.tensors
        return None if tensors is None else tensors.growth_tracker

    @_growth_tracker.setter
    def _growth_tracker(self, value: torch.Tensor | None) -> None:
        if value is not None:
            self._lazy_init_scale_growth_tracker(value.device)
            self._loss_scale.tensors.growth_tracker = value

    # torch's initial values, used when the state is created (lazily, or after a load)
    @property
    def _init_scale(self) -> float:
        return self._loss_scale.numbers.scale

    @property
    def _init_growth_tracker(self) -> int:
        return self._loss_scale.numbers.growth_tracker

    @_init_growth_tracker.setter
    def _init_growth_tracker(self, value: int) -> None:  # writable as in torch (its tests set it)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"_init_growth_tracker must be an int >= 0; got {value!r}.")
        numbers = self._loss_scale.numbers
        self._loss_scale.numbers = dataclasses.replace(numbers, growth_tracker=value)

    # torch's attributes for the policy, read and written through the config
    _growth_factor = property(
        lambda self: self._config.growth_factor, lambda self, v: self.set_growth_factor(v)
    )
    _backoff_factor = property(
        lambda self: self._config.backoff_factor, lambda self, v: self.set_backoff_factor(v)
    )
    _growth_interval = property(
        lambda self: self._config.growth_interval, lambda self, v: self.set_growth_interval(v)
    )

    @property
    def _per_optimizer_states(self) -> dict[int, dict[str, Any]]:
        """torch's per-optimizer records of this iteration (see :mod:`shardscale._iteration`)."""
        return self._it.states

    @_per_optimizer_states.setter
    def _per_optimizer_states(self, value: dict[int, dict[str, Any]]) -> None:
        self._it.states = value

    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        """Create the scale state on ``dev`` (as torch's method; also public in effect, as
        :meth:`place`). Idempotent: a state that exists already stays where it is."""
        if self._loss_scale.tensors is None:
            self._placed(self._loss_scale.place(torch.device(dev)))

    def _placed(self, state: Any) -> None:
        """The scale state was created or moved (the facade creates its alarm there)."""

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        tracker = self._growth_tracker
        return self._init_growth_tracker if tracker is None else int(tracker.item())

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor | None,
        allow_fp16: bool = True,
        amax: dict[torch.device, torch.Tensor] | None = None,
        check_only: bool = False,
    ) -> dict[torch.device, torch.Tensor]:
        """torch's local unscale: ``optimizer``'s local gradients times ``inv_scale``, in place;
        ``{device: found_inf}`` (0-d float32 copies of ``found_inf``, or zeros for None, 1.0
        where a gradient held inf/NaN). No collective. Gradients ``clip_grad_norm_(params)``
        unscaled already are left out. ``allow_fp16=False`` refuses fp16 gradients, as torch.
        ``amax`` (shardscale's, ``policy="headroom"``): filled with the largest |gradient| per
        device before unscaling (``check_only``: only checked; :func:`_grads.measure_and_check`).

        Raises:
            SharedMemoryGradError: a gradient whose elements share memory, named, before any
                write.
            ValueError: fp16 gradients with ``allow_fp16=False``.
        """
        if self._calls.shadowing:  # a joined rank: no gradients of this iteration
            return {}
        params = list(iter_params(optimizer))
        try:
            buckets = bucket_grads(params, skip=self._it.pre_unscaled)
        except SharedMemoryGradError as e:
            raise e.naming(self._names.current(), params) from None
        if not allow_fp16 and any(torch.float16 in b for b in buckets.values()):
            raise ValueError("Attempting to unscale FP16 gradients.")
        if amax is not None and found_inf is None:
            return measure_and_check(buckets, inv_scale, amax, check_only)
        return unscale_and_check(buckets, inv_scale, found_inf)

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, torch.Tensor]:
        """torch's check without unscaling: records and returns ``optimizer``'s agreed
        ``{scale device: found_inf}`` (one all-reduce, as :meth:`unscale_`)."""
        state = self._begin("_check_inf_per_device", optimizer)
        return self._check(optimizer, state, unscale=False)["found_inf_per_device"]

    # torch's public getters and setters
    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 if disabled). One host read."""
        if not self._enabled:
            return 1.0
        scale = self._scale
        return self._init_scale if scale is None else float(scale.item())

    def get_growth_factor(self) -> float:
        """The growth factor (a Python float)."""
        return self._config.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (> 1). Raises TypeError/ValueError, leaving it unchanged."""
        self._config = self._config.with_growth_factor(new_factor)
        warn_unused_setter(self._config, "growth_factor")

    def get_backoff_factor(self) -> float:
        """The backoff factor (a Python float)."""
        return self._config.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in (0, 1)). Raises TypeError/ValueError, leaving it unchanged."""
        self._config = self._config.with_backoff_factor(new_factor)
        warn_unused_setter(self._config, "backoff_factor")

    def get_growth_interval(self) -> int:
        """The growth interval (a Python int)."""
        return self._config.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (int >= 1). Raises TypeError/ValueError, leaving it unchanged.
        Clean steps beyond the new interval: the next clean step grows (the rule's >=)."""
        self._config = self._config.with_growth_interval(new_interval)
        self._loss_scale.cap_growth_tracker(self._config.growth_interval - 1)
        warn_unused_setter(self._config, "growth_interval")

    def is_enabled(self) -> bool:
        """Whether scaling is enabled."""
        return self._enabled

    # the scaler's: _begin (the facade), _check (_checking.Checking)
    _begin: Any
    _check: Any
