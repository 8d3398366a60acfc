"""CPU scaffolding for running torchtitan 0.3.0 in the tests, and the tests' config registry.

torchtitan 0.3.0 targets CUDA and a newer torch than the 2.13 the project tests with. On a CPU
machine with torch 2.13 it needs, and this module provides (for the tests only; shardscale's
integration does none of it):

* an optional ``triton``: ``torchtitan.trainer`` imports MinimalAsyncEP's triton kernels
  unconditionally; a stand-in module with those kernel names (raising if called) is put in their
  place, and torch never sees a fake ``triton``;
* a CPU device: torchtitan falls back to ``"cuda"`` when no accelerator is found, and calls
  ``get_device_name``/``memory_stats``/... on the device module, which ``torch.cpu`` lacks; while
  ``torchtitan.tools.utils`` is imported, torch's device probe answers ``"cpu"`` and a CPU
  device module with those functions;
* ``torch.distributed.set_timeout`` (which torchtitan calls after the first step), from torch's
  ``_set_pg_timeout``;
* CPU-friendly model settings (:func:`cpu_config`): SDPA attention (FlexAttention has no CPU
  backward), the ``partial_dtensor`` SPMD backend (torch 2.13's ``fully_shard`` does not take
  the ``spmd_types`` backend's annotated parameters), SUM reductions in FSDP2's reduce-scatter
  (gloo has no ``PREMUL_SUM``), 2 layers, short sequences;
* an offline tokenizer and a small ``c4_test``-style JSON data set (:func:`write_assets`).

The config registry (``--module _titan --config tiny``, or through shardscale:
``--module shardscale.integrations.torchtitan --config _titan:tiny``) builds
:class:`RecordingTrainer`, which records each step and can write an inf into one rank's gradient.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import random
import sys
import types
from dataclasses import dataclass
from typing import Any

import torch

_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
_KERNEL_NAMES = (
    "copy_full_counts_to_peers_kernel",
    "copy_rows_to_peers_kernel",
    "expand_topk_grad_kernel",
    "fill_combine_metadata_kernel",
    "fill_dispatch_metadata_kernel",
    "invert_flat_indices_kernel",
    "reduce_topk_slots_kernel",
    "topk_scores_grad_kernel",
)


def install_cpu_scaffolding() -> None:
    """Make torchtitan importable and runnable on the CPU (idempotent). Call it before anything
    imports torchtitan's modules."""
    if _KERNELS not in sys.modules:
        try:
            import triton  # noqa: F401
        except ImportError:
            kernels = types.ModuleType(_KERNELS, "triton kernels: not on this machine")

            def _needs_triton(*args: Any, **kwargs: Any) -> None:
                raise RuntimeError("MinimalAsyncEP needs triton, which this machine lacks.")

            for name in _KERNEL_NAMES:
                setattr(kernels, name, _needs_triton)
            sys.modules[_KERNELS] = kernels
    if "torchtitan.tools.utils" not in sys.modules and not torch.cuda.is_available():
        import torch._utils as tu

        probe, module_of = tu._get_available_device_type, tu._get_device_module
        cpu = types.ModuleType("cpu_device_module", "torch.cpu plus what torchtitan asks of it")
        cpu.__dict__.update({k: v for k, v in vars(torch.cpu).items() if not k.startswith("__")})
        cpu.get_device_name = lambda device=None: "cpu"
        cpu.get_device_properties = lambda device=None: types.SimpleNamespace(
            name="cpu", total_memory=64 * 2**30
        )
        cpu.current_device = lambda: 0
        cpu.memory_stats = lambda device=None: {}
        cpu.reset_peak_memory_stats = lambda device=None: None
        cpu.empty_cache = lambda: None
        tu._get_available_device_type = lambda: "cpu"
        tu._get_device_module = lambda kind: cpu if kind == "cpu" else module_of(kind)
        try:
            import torchtitan.tools.utils  # noqa: F401  (reads the device once, at import)
        finally:
            tu._get_available_device_type, tu._get_device_module = probe, module_of
    import torch.distributed as dist

    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = lambda timeout, group=None: _set_pg_timeout(timeout, group)


# ------------------------------------------------------------------------------- assets
WORDS = [f"w{i}" for i in range(400)]


def write_assets(folder: str) -> dict[str, str]:
    """A word-level tokenizer (``tokenizer.json``, ``tokenizer_config.json`` with BOS/EOS) and a
    ``c4_test``-style data set (``data.json``, one ``{"text": ...}`` per line) under
    ``folder``; returns their folders. Deterministic; nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer_dir = os.path.join(folder, "tokenizer")
    data_dir = os.path.join(folder, "c4_test")
    os.makedirs(tokenizer_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(os.path.join(tokenizer_dir, "tokenizer.json"))
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<bos>", "eos_token": "<eos>"}, f)
    rng = random.Random(0)
    with open(os.path.join(data_dir, "data.json"), "w") as f:
        for _ in range(400):
            # a skewed word distribution: something to learn in a few steps
            n = rng.randint(16, 64)
            text = " ".join(
                WORDS[min(int(rng.expovariate(0.05)), len(WORDS) - 1)] for _ in range(n)
            )
            f.write(json.dumps({"text": text}) + "\n")
    return {"tokenizer": tokenizer_dir, "data": data_dir}


# ------------------------------------------------------------------------ recording trainer
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _digest(model_parts: list[torch.nn.Module]) -> str:
    """sha256 of every parameter's full value (shards gathered: a collective)."""
    h = hashlib.sha256()
    for part in model_parts:
        for name, p in part.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            h.update(name.encode())
            h.update(full.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class ListLogger:
    """A torchtitan metrics logger (``metrics_processor.logger``) keeping what it is given."""

    def __init__(self) -> None:
        self.logged: list[dict[str, Any]] = []

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.logged.append({"step": step, **metrics})

    def close(self) -> None:
        pass


@functools.cache
def _trainer_classes() -> tuple[type, type]:
    from torchtitan.trainer import Trainer

    class RecordingTrainer(Trainer):
        """torchtitan's Trainer that records every step (:attr:`records`), keeps the first
        step's raw gradients (:attr:`first_grads`, this rank's shards, before any unscale) and
        writes an inf into one gradient on ``inf_rank`` at the steps ``inf_steps``."""

        @dataclass(kw_only=True, slots=True)
        class Config(Trainer.Config):
            inf_steps: list[int] = dataclasses.field(default_factory=list)
            """Steps at which an inf is written into a gradient (after the backward)."""

            inf_rank: int = 1
            """The rank whose gradient gets the inf."""

            textbook_scale: float = 0.0
            """If > 0: the textbook recipe, backward() of the returned loss times this."""

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.records: list[dict[str, Any]] = []
            self.first_grads: torch.Tensor | None = None
            self.metrics_processor.logger = self.list_logger = ListLogger()

        def forward_backward_step(self, **kwargs: Any) -> torch.Tensor:
            loss = super().forward_backward_step(**kwargs)
            grads = [p.grad for m in self.model_parts for p in m.parameters()]
            if self.first_grads is None:
                self.first_grads = torch.cat([_local(g).detach().reshape(-1) for g in grads])
            rank = torch.distributed.get_rank()
            if self.step in self.config.inf_steps and rank == self.config.inf_rank:
                _local(grads[0]).view(-1)[0] = float("inf")
            return loss

        def _forward_backward_body(self, inputs, labels, global_valid_tokens, extra_kwargs):
            scale = self.config.textbook_scale
            if not scale:
                return super()._forward_backward_body(
                    inputs, labels, global_valid_tokens, extra_kwargs
                )
            with self.train_context():  # torchtitan's body, with scaler.scale(loss).backward()
                pred = self.model_parts[0](inputs, **extra_kwargs)
                loss_kwargs = {k: extra_kwargs[k] for k in ("positions",) if k in extra_kwargs}
                loss, _ = self.loss_fn(pred, labels, global_valid_tokens, **loss_kwargs)
                (loss * scale).backward()
            return loss

        def train_step(self, data_iterator: Any) -> None:
            super().train_step(data_iterator)
            scaler = getattr(self, "scaler", None)
            schedulers = self.lr_schedulers.schedulers
            self.records.append(
                {
                    "step": self.step,
                    "scaler": scaler.metrics() if scaler is not None else None,
                    "lr": schedulers[0].get_last_lr()[0],
                    "last_epoch": schedulers[0].last_epoch,
                    "params": _digest(self.model_parts),
                }
            )

    return RecordingTrainer, Trainer


def cpu_config() -> Any:
    """torchtitan's llama3 debug model config with the CPU settings of the module docstring
    (2 layers, sequences of 32 tokens, 2 per rank, 4 loss chunks, 8 steps), training the
    :class:`RecordingTrainer` on the data of ``$TITAN_ASSETS`` (see :func:`write_assets`)."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3 import config_registry

    recording, _ = _trainer_classes()
    base = config_registry.llama3_debugmodel()
    spec = base.model_spec
    spec.model.layers = spec.model.layers[:2]
    for _, _, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    spec.parallelize_fn = _sum_reductions(spec.parallelize_fn)
    folder = os.environ.get("TITAN_ASSETS", "")
    base.hf_assets_path = os.path.join(folder, "tokenizer")
    base.dataloader.dataset_path = os.path.join(folder, "c4_test")
    base.training.seq_len = 32
    base.training.local_batch_size = 2
    base.training.steps = 8
    base.training.disable_cuda_graphs = True
    base.loss.num_chunks = 4
    base.parallelism.spmd_backend = "partial_dtensor"
    base.validator.enable = False
    base.activation_checkpoint = None
    base.comm.init_timeout_seconds = 60
    base.comm.train_timeout_seconds = 30
    base.debug.seed = 0
    values = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    return recording.Config(**values)


def _sum_reductions(parallelize: Any) -> Any:
    def parallelize_for_gloo(model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        from torch.distributed.fsdp import FSDPModule

        model = parallelize(model, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)  # gloo: no PREMUL_SUM
        return model

    return parallelize_for_gloo


def tiny() -> Any:
    """The config registry entry: ``--module _titan --config tiny``."""
    return cpu_config()
