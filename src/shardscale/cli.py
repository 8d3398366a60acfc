"""The ``shardscale`` command: ``shardscale train ...`` (the benchmark is ``benchmarks/bench.py``
in the source tree)."""

from __future__ import annotations

import sys

USAGE = """usage: shardscale train [options]

  train   fp16 sharded data-parallel training on real data (see `shardscale train --help`)
"""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shardscale`` console script. Returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args else 2
    if args[0] == "train":
        from .train import main as train_main

        return train_main(args[1:])
    print(f"shardscale: error: unknown command {args[0]!r}\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
