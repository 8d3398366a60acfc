"""``shardscale train``: fp16 sharded data-parallel training that shows the scaler at work.

Modules (one job each, torchtitan-like):

* :mod:`~shardscale.train.cli`: parse and validate in the parent, launch ranks with torch's
  elastic launcher (``shardscale train``).
* :mod:`~shardscale.train.worker`: one rank (``python -m shardscale.train.worker``, or under
  ``torchrun`` for several nodes).
* :mod:`~shardscale.train.config`: the options (one parser for launcher and workers).
* :mod:`~shardscale.train.data`: scikit-learn digits or a UTF-8 text file, split across ranks.
* :mod:`~shardscale.train.model`: an MLP and a small character-level transformer.
* :mod:`~shardscale.train.parallel`: FSDP2 / FSDP1 / DDP / none, precision, scaler choice.
* :mod:`~shardscale.train.loop`: the training loop and evaluation.
* :mod:`~shardscale.train.checkpoint`: full-state checkpoints, atomic writes, resume.
* :mod:`~shardscale.train.report`: ``metrics.jsonl``, the plot, the summary table.
"""


def main(argv: list[str] | None = None) -> int:
    """``shardscale train`` (see :func:`shardscale.train.cli.main`)."""
    from .cli import main as cli_main

    return cli_main(argv)


__all__ = ["main"]
