"""Overflow diagnostics: which parameters held inf/NaN gradients, on which rank.

The scan costs one pass over the gradients and is only run on steps that overflowed;
:class:`Reporter` scans, gathers over ranks when asked, and caches the last report.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from . import _sync
from ._alarm import POLL_EVERY
from ._config import ScalerConfig, round_f32
from ._grads import grad_values, to_device
from ._iteration import Iteration, LastStep
from ._policy import ScaleState

logger = logging.getLogger("shardscale")


class ScaleCollapseError(RuntimeError):
    """The loss scale collapsed: it sits at ``min_scale`` and gradients still overflow, or
    ``max_consecutive_skips`` steps in a row were skipped. Training makes no progress.

    Attributes:
        step: ``update()`` calls done before the failing step (its 0-based index, as
            :attr:`OverflowReport.step`).
        scale: the loss scale when the error was raised (a Python float).
        report: the :class:`OverflowReport` of this rank for the failing step, or None.
    """

    def __init__(self, message: str, step: int, scale: float, report: OverflowReport | None):
        super().__init__(message)
        self.step = step
        self.scale = scale
        self.report = report


@dataclasses.dataclass(frozen=True)
class OverflowEntry:
    """One parameter whose gradient held non-finite values on one rank.

    Attributes:
        name: fully-qualified parameter name (``"<param i of optimizer j>"`` when unnamed).
        rank: global rank that held the bad gradient shard (0 without torch.distributed).
        n_inf: number of +/-inf elements in that rank's gradient shard.
        n_nan: number of NaN elements in that rank's gradient shard.
        numel: number of elements of the shard.
        dtype: gradient dtype, as a string (e.g. ``"torch.float16"``).
        device: gradient device, as a string.
    """

    name: str
    rank: int
    n_inf: int
    n_nan: int
    numel: int
    dtype: str
    device: str


@dataclasses.dataclass(frozen=True)
class OverflowReport:
    """Where the non-finite gradients of one step were.

    Attributes:
        step: ``update()`` calls done before this step (0-based step index).
        scale: the loss scale the gradients were computed with.
        entries: one :class:`OverflowEntry` per (parameter, rank) with non-finite values, sorted
            by rank then name. Empty if the overflow came from a rank not included in the gather.
    """

    step: int
    scale: float
    entries: tuple[OverflowEntry, ...]

    @property
    def ranks(self) -> list[int]:
        """Sorted ranks that held non-finite gradients."""
        return sorted({e.rank for e in self.entries})

    @property
    def names(self) -> list[str]:
        """Sorted names of the parameters with non-finite gradients (on any rank)."""
        return sorted({e.name for e in self.entries})

    def __str__(self) -> str:
        head = f"overflow at step {self.step} (loss scale {self.scale:g}):"
        if not self.entries:
            return head + " no non-finite gradient found in the scanned parameters"
        lines = [head]
        for e in self.entries:
            lines.append(
                f"  rank {e.rank}: {e.name} ({e.dtype}, {e.numel} elements on {e.device}): "
                f"{e.n_inf} inf, {e.n_nan} NaN"
            )
        return "\n".join(lines)


class ParamNames:
    """Names of parameters for reports.

    From a module (the usual ``param_names=model``): for each parameter, a weak reference to the
    submodule that registers it (recorded by :meth:`ShardedGradScaler.set_param_names`), its
    attribute name and its id then. A report names a gradient by the parameter its submodule
    holds at that moment (so a parameter replaced since is named), else by the id recorded
    (FSDP2 between forward and resharding, parametrizations), and only while that submodule
    lives: a freed model names nothing, so a dead parameter's reused id never names a stranger.
    Parameters registered after the call are not named (call it again). No reference of any
    kind to the parameters is held: torch refuses to swap tensors that have weak references.
    From a ``{name: parameter}`` map: ids, valid while those parameters live. Pickling drops
    the names; :meth:`remapped` follows a ``copy.deepcopy``.

    Attributes:
        root: a weak reference to the module named from (None for a map): its module tree
            (FSDP units, for :func:`shardscale._numerics.measure`) as of when it is asked.
    """

    def __init__(
        self,
        pairs: Iterable[tuple[str, torch.Tensor]] = (),
        module: torch.nn.Module | None = None,
    ) -> None:
        self._by_id: dict[int, str] = {id(p): name for name, p in pairs}
        #: (weak ref to the owning submodule, attribute name, full name, id of the parameter)
        self._owners: list[tuple[weakref.ref, str, str, int]] = []
        self.root: weakref.ref[torch.nn.Module] | None = None
        if module is not None:
            self.root = weakref.ref(module)
            for prefix, sub in module.named_modules(remove_duplicate=False):
                for attr, param in sub._parameters.items():
                    if param is not None:
                        full = f"{prefix}.{attr}" if prefix else attr
                        self._owners.append((weakref.ref(sub), attr, full, id(param)))

    def current(self) -> dict[int, str]:
        """``{id(parameter): name}`` as of now."""
        if not self._owners:
            return self._by_id
        out: dict[int, str] = {}
        recorded: dict[int, str] = {}
        for ref, attr, full, pid in self._owners:
            sub = ref()
            if sub is None:
                continue  # the named model is gone
            param = getattr(sub, attr, None)
            if isinstance(param, torch.Tensor):
                out.setdefault(id(param), full)  # a shared parameter keeps its first name
            recorded.setdefault(pid, full)
        for pid, full in recorded.items():
            out.setdefault(pid, full)
        return out

    def remapped(self, memo: Mapping[int, Any]) -> ParamNames:
        """For a ``copy.deepcopy``: what was copied before the scaler in the same call (in
        ``memo``) is named in its copy; the rest keeps its names (the copy shares it)."""
        new = ParamNames()
        root = self.root() if self.root is not None else None
        if root is not None:
            copied = memo.get(id(root))
            new.root = weakref.ref(copied if isinstance(copied, torch.nn.Module) else root)
        for ref, attr, full, pid in self._owners:
            sub = ref()
            if sub is not None:
                copied_sub, copied_param = memo.get(id(sub)), memo.get(pid)
                target = copied_sub if isinstance(copied_sub, torch.nn.Module) else sub
                new_pid = id(copied_param) if isinstance(copied_param, torch.Tensor) else pid
                new._owners.append((weakref.ref(target), attr, full, new_pid))
        for key, name in self._by_id.items():
            copied = memo.get(key)
            new._by_id[id(copied) if isinstance(copied, torch.Tensor) else key] = name
        return new

    def __len__(self) -> int:
        return len(self.current())


def name_params(source: torch.nn.Module | Mapping[str, torch.Tensor] | None) -> ParamNames:
    """:class:`ParamNames` from a module (read at report time) or a ``{name: param}`` map.

    Raises:
        TypeError: neither a module nor a ``{str: tensor}`` mapping.
    """
    if source is None:
        return ParamNames()
    if isinstance(source, torch.nn.Module):
        return ParamNames(module=source)
    if isinstance(source, Mapping):
        items = list(source.items())
        for name, p in items:
            if not isinstance(name, str) or not isinstance(p, torch.Tensor):
                raise TypeError(
                    "param names must map str names to parameters, got "
                    f"{type(name).__name__} -> {type(p).__name__}."
                )
        return ParamNames(items)
    raise TypeError(
        f"param names must come from an nn.Module or a {{name: parameter}} mapping, got "
        f"{type(source).__name__}."
    )


def scan_local(
    optimizers: Iterable[torch.optim.Optimizer], names: ParamNames, rank: int
) -> list[OverflowEntry]:
    """Count inf/NaN in every local gradient shard of ``optimizers`` (no collective).

    One host read per gradient tensor: only for steps that overflowed.
    """
    entries: list[OverflowEntry] = []
    by_id = names.current()
    for j, opt in enumerate(optimizers):
        i = 0
        for group in opt.param_groups:
            for p in group["params"]:
                i += 1
                g = grad_values(p, coalesce_all=True)  # local shard / sparse values
                if g is None:
                    continue
                with torch.no_grad():  # one host read per tensor
                    n_nan, n_inf = torch.stack(
                        [torch.isnan(g).sum(), torch.isinf(g).sum()]
                    ).tolist()
                if n_nan or n_inf:
                    name = by_id.get(id(p), f"<param {i - 1} of optimizer {j}>")
                    entries.append(
                        OverflowEntry(
                            name, rank, n_inf, n_nan, g.numel(), str(g.dtype), str(g.device)
                        )
                    )
    return entries


def collapse_error(
    config: ScalerConfig, step: int, scale: float, entries: list[OverflowEntry], rank: int
) -> ScaleCollapseError:
    """The :class:`ScaleCollapseError` for a collapse at ``step`` (0-based) with ``scale``.

    ``entries`` are the non-finite gradients found (from :func:`scan_local`, gathered over the
    ranks where every rank detects the collapse at once); the message names them with their
    ranks, says why the guard fired, and what to look for.
    """
    look = (
        "look for a NaN loss or input, a bad learning rate, an fp16 overflow in the forward "
        "pass (compute that op in fp32 or use bf16), or a log/div of zero."
    )
    if config.max_consecutive_skips is not None and scale > round_f32(config.floor):
        why = f"{config.max_consecutive_skips}+ consecutive skipped steps"
        # the scale may still be too high: e.g. a large init_scale backing off step by step
        cause = (
            f"The scale was still {scale:g} (fp16's largest value is 65504): if it has been "
            "backing off from a high init_scale, the scaled loss or gradients may overflow "
            "until it is low enough (lower init_scale or raise max_consecutive_skips); else "
        )
    else:
        floor = (
            f"its floor {config.floor:g} (policy='headroom': the smallest power of two >= "
            "max(min_scale, 1))"
            if config.headroom
            else f"min_scale={config.min_scale:g}"
        )
        why = f"the loss scale sits at {floor} and gradients still overflow"
        cause = "The NaN/inf does not come from the scale: "
    where = ", ".join(
        f"{e.name} on rank {e.rank} ({e.n_inf} inf, {e.n_nan} NaN)" for e in entries
    ) or (
        "none in the last step's gradients (scanned when the alarm is read: up to "
        f"{POLL_EVERY} updates after the collapse with fused optimizers or a compiled loop; or "
        "zeroed already, or on a rank not scanned)"
    )
    msg = (
        f"loss scale collapsed at step {step} (rank {rank}, loss scale {scale:g}): {why}. "
        f"Non-finite gradients: {where}. {cause}{look}"
    )
    return ScaleCollapseError(msg, step, scale, OverflowReport(step, scale, tuple(entries)))


class Reporter:
    """The scaler's overflow reports: where the non-finite gradients of the last stepped
    iteration were, on this rank (:func:`scan_local`) or every rank (a gather), the last one
    cached until the next ``update()``.

    Attributes:
        names: how parameters are named (:class:`ParamNames`).
        cached: ``(all_ranks, report)`` of the last report built, or None.
    """

    def __init__(self, names: ParamNames) -> None:
        self.names = names
        self.cached: tuple[bool, OverflowReport] | None = None

    def forget(self) -> None:
        """A new iteration was closed: a cached report is out of date."""
        self.cached = None

    def report(
        self,
        it: Iteration,
        state: ScaleState | None,
        all_ranks: bool,
        groups: list[Any],
        shadowing: bool = False,
    ) -> OverflowReport | None:
        """The report of the iteration in progress (what was checked so far) or of the last
        one ``update()`` closed; None when it was clean (one host read to know).

        Args:
            it: the scaler's record.
            state: the scale state (None before it exists: nothing to report).
            all_ranks: gather every rank's entries over ``groups`` (collective).
            groups: the scaler's process groups.
            shadowing: a joined rank (no gradients of its own: it only takes part in the
                gather).
        """
        flags, refs = it.inf_checks()
        if flags and state is not None:  # mid-iteration: what was checked so far
            found = sum(to_device(f, state.scale.device) for f in flags)
            last = LastStep(state.counters, 0, state.scale.clone(), found, refs)
        elif it.last is not None:
            last = it.last
        else:
            return None
        if not bool(last.found_inf > 0):  # the one host read
            return None
        cached = self.cached
        if cached is not None and cached[0] == all_ranks and cached[1].step == last.index:
            return cached[1]
        return self.build(last, groups if all_ranks else [], shadowing, all_ranks)

    def build(
        self, last: LastStep, groups: list[Any], shadowing: bool = False, all_ranks: bool = True
    ) -> OverflowReport:
        """The report of ``last``, gathered over ``groups`` (none: this rank's), cached."""
        entries = self.scan(last.live_optimizers(), groups, shadowing)
        report = OverflowReport(last.index, float(last.scale), tuple(entries))
        self.cached = (all_ranks, report)
        return report

    def log(self, last: LastStep, groups: list[Any], shadowing: bool = False) -> None:
        """``report_overflows``: ``last``'s report, gathered over ``groups`` (every rank takes
        part), logged once as a warning on the ``"shardscale"`` logger, by the rank that is rank
        0 of every group (each rank holds the same gathered report)."""
        report = self.build(last, groups, shadowing)
        if all(g.rank() == 0 for g in groups):
            logger.warning("%s", report)

    def collapsed(
        self,
        collapse: tuple[int, float],
        config: ScalerConfig,
        last: LastStep | None,
        groups: list[Any],
        shadowing: bool = False,
    ) -> None:
        """The alarm read a collapse (``(step, scale)``): raise the :class:`ScaleCollapseError`
        naming every rank's non-finite gradients of ``last`` (gathered over ``groups``: every
        rank reads the alarm at the same update), or warn with it (``on_collapse="warn"``).

        Raises:
            ScaleCollapseError: ``config.on_collapse == "raise"``.
        """
        optimizers = last.live_optimizers() if last is not None else []
        entries = self.scan(optimizers, groups, shadowing)
        error = collapse_error(config, *collapse, entries, _sync.rank())
        if config.on_collapse == "raise":
            raise error
        warnings.warn(str(error), RuntimeWarning, stacklevel=4)

    def scan(self, optimizers: list[Any], groups: list[Any], shadowing: bool = False) -> list:
        """The non-finite gradients of ``optimizers`` on this rank, gathered over ``groups``
        (an ``all_gather_object`` per group: collective), sorted by rank and name."""
        entries = [] if shadowing else scan_local(optimizers, self.names, _sync.rank())
        if groups:
            entries = _sync.gather_objects(entries, groups)
        return sorted(entries, key=lambda e: (e.rank, e.name))
