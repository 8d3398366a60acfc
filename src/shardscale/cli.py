"""The ``shardscale`` command: ``shardscale train ...`` and ``shardscale bench ...``."""

from __future__ import annotations

import sys

USAGE = """usage: shardscale {train,bench} [options]

  train   fp16 sharded data-parallel training on real data (see `shardscale train --help`)
  bench   unscale/check, scaler-cycle and clipping benchmark (see `shardscale bench --help`)
"""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shardscale`` console script. Returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "train":
        from .train.cli import main as train_main

        return train_main(rest)
    if command == "bench":
        from .bench import main as bench_main

        return bench_main(rest)
    print(f"shardscale: error: unknown command {command!r}\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
