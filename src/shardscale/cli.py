"""The ``shardscale`` command: ``shardscale train ...``, ``shardscale bench ...`` and
``shardscale build``."""

from __future__ import annotations

import sys

USAGE = """usage: shardscale {train,bench,build} [options]

  train   fp16 sharded data-parallel training on real data (see `shardscale train --help`)
  bench   unscale/check, scaler-cycle and clipping benchmark (see `shardscale bench --help`)
  build   compile the CPU kernel and the C++ gradient gathering now (else at the first CPU
          step: ~15-25 s once per torch version) and say whether they are in use
"""


BUILD_USAGE = """usage: shardscale build

Compile shardscale's CPU kernel and C++ gradient gathering for this torch (or load them from
the cache) and say whether each is in use. Exit 0 when both are, 1 otherwise (shardscale then
uses torch's kernel and the Python path: same results, slower).
"""


def build_cpu_parts(who: str, notice_after: float = 2.0) -> None:
    """Build (or load from the cache) the compiled CPU kernel and gathering; a build that takes
    longer than ``notice_after`` seconds (the first run for a torch version: ~15-25 s) says what
    the pause is on stderr, prefixed with ``who`` (e.g. ``"shardscale train"``)."""
    import threading

    from . import _gather

    notice = threading.Timer(
        notice_after,
        lambda: print(
            f"{who}: building shardscale's compiled CPU parts (once per torch version, cached) ...",
            file=sys.stderr,
            flush=True,
        ),
    )
    notice.daemon = True
    notice.start()
    try:
        _gather.status()  # builds the kernel first
    finally:
        notice.cancel()


def build() -> int:
    """``shardscale build``: build (or load from the cache) the compiled CPU parts and print
    whether each is in use and why not. Returns 0 when both are, else 1 (shardscale still runs
    without them, on torch's kernel and the Python path)."""
    from . import _cpukernel, _gather

    try:
        build_cpu_parts("shardscale build")
        kernel = _cpukernel.status()
    except (_cpukernel.CpuKernelError, ValueError) as e:  # SHARDSCALE_CPU_KERNEL=1 or a bad value
        print(f"shardscale build: error: {e}", file=sys.stderr)
        return 1
    names = ", ".join(str(d).removeprefix("torch.") for d in kernel.dtypes)
    print(
        "shardscale build: CPU kernel: "
        + (f"in use for {names} ({kernel.reason})" if kernel.available else kernel.reason)
    )
    gathering, where = _gather.status()
    print(
        "shardscale build: C++ gradient gathering: "
        + ("in use" if gathering else "not in use")
        + f" ({where})"
    )
    return 0 if kernel.available and gathering else 1


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
    if command == "build":
        if rest in (["-h"], ["--help"]):
            print(BUILD_USAGE, end="")
            return 0
        if rest:
            print(f"shardscale build: error: it takes no options, got {rest}", file=sys.stderr)
            return 2
        return build()
    print(f"shardscale: error: unknown command {command!r}\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
