"""The compiled CPU kernels (unscale + inf/NaN check, multiply, per-tensor norms), and their
fallback to torch's.

torch's CPU ``_amp_foreach_non_finite_check_and_unscale_`` costs 1.3-1.5x an in-place multiply
over float32 gradients (its vectorised inf/NaN test branches every 8-16 elements). The C kernel
in ``_cpukernel.c`` tests the exponent bits without branches and splits all of a bucket's elements
over the threads in one parallel region: it runs at or below the cost of ``torch._foreach_mul_``
over the same bytes (BENCHMARKS.md), with the same results bit for bit (NaN payloads aside). Its
norms (p = 1, 2, inf) are summed in float64, from one read of the gradients.

It is built at first use with the system C compiler (``$CC``, else ``cc``/``gcc``/``clang``) and
OpenMP (1-3 s, once), and cached in ``$SHARDSCALE_CACHE_DIR`` (default
``$XDG_CACHE_HOME/shardscale`` or ``~/.cache/shardscale``; else ``<tmp>/shardscale-<uid>``)
under a hash of the source, the compiler's version and the platform. A directory or library
that another user owns or could write (or, in the temp dir, a symlink) is never used. x86-64
builds carry AVX-512, AVX2 and baseline clones picked at load time (and, for float16/bfloat16
writes, hand-written AVX-512 loops used where the CPU has AVX-512F/BW: the compiler's loops are
compute-bound there), so a cache shared between machines is safe. On Linux the library binds to
the OpenMP runtime torch already loaded (``libgomp.so.1``), so both share one thread pool (a
torch built with another OpenMP runtime would get a second pool: ``SHARDSCALE_CPU_KERNEL=0``
avoids it).

Threads: ``torch.get_num_threads()``, in one parallel region per call, entered only where
torch's per-tensor kernels would enter one too (a tensor of more than 32768 elements): GNU OpenMP
cannot start threads in a child forked after its parent used them, so a forked child hangs here
only where torch would.

``SHARDSCALE_CPU_KERNEL`` selects it: ``auto`` (default: use it when it builds, else torch's
kernel, logged once at INFO on the ``shardscale`` logger), ``0`` (always torch's kernel), ``1``
(require it: :func:`status` raises if it cannot be built).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import math
import os
import platform
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("shardscale")

ENV = "SHARDSCALE_CPU_KERNEL"
CACHE_ENV = "SHARDSCALE_CACHE_DIR"
_SOURCE = Path(__file__).with_name("_cpukernel.c")
#: The -fno-* last: a $CC carrying -Ofast/-ffast-math/-funsafe-math-optimizations must neither
#: drop the NaN tests nor link crtfastmath.o (which sets flush-to-zero for the whole process)
_FLAGS = (
    "-O3",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-fno-fast-math",
    "-fno-unsafe-math-optimizations",
)
#: The device key of CPU buckets: one object, so the step path compares it by identity.
CPU = torch.device("cpu")
_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_BUILD_TIMEOUT_S = 300
#: A batch for writes takes at most ``_SMALL_CAP`` tensors of fewer than ``_SMALL`` elements
#: (biases, norm weights); further small ones stay with torch's foreach kernel. Taking one costs
#: ~0.35 us of Python (its address and layout); the one torch call that handles the small tensors
#: left over costs ~10 us, and ~50 us right after a backward pass has streamed through the caches:
#: few small tensors are cheaper in the kernel, thousands cheaper in torch's.
_SMALL = 8192
_SMALL_CAP = 128


@dataclass(frozen=True)
class LibSpec:
    """What to build into a cached shared library: the source, the compiler, its flags.

    Attributes:
        prefix: the library's file name prefix (``<prefix>-<key>.so``).
        source: the source file.
        compilers: ``(environment variable, names to look for on $PATH)`` for the compiler.
        flags: compiler flags, after the compiler and before the source.
        link: linker flags, after the source.
        key: further bytes the cache key depends on (e.g. torch's and Python's versions).
        loader: ``ctypes.PyDLL`` for functions called with the GIL held; None: ``ctypes.CDLL``
            (the GIL released during calls).
        install: the compiler package to suggest when none is found.
    """

    prefix: str
    source: Path
    compilers: tuple[str, tuple[str, ...]] = ("CC", ("cc", "gcc", "clang"))
    flags: tuple[str, ...] = ()
    link: tuple[str, ...] = ()
    key: bytes = b""
    loader: Any = None
    install: str = "gcc"


#: The CPU kernel: plain C with OpenMP.
KERNEL = LibSpec("cpukernel", _SOURCE, flags=_FLAGS)


@dataclass(frozen=True)
class KernelStatus:
    """Whether the compiled CPU kernel is in use.

    Attributes:
        available: True if CPU unscales of float32/bfloat16 (and float16 where the CPU has F16C,
            or on aarch64) go through the compiled kernel.
        reason: why not (mode ``0``, no compiler, the compiler's error), or the library's path.
        dtypes: the dtypes it handles on this CPU; others use torch's kernel.
    """

    available: bool
    reason: str
    dtypes: tuple[torch.dtype, ...] = ()


class CpuKernelError(RuntimeError):
    """``SHARDSCALE_CPU_KERNEL=1`` but the kernel could not be built or loaded."""


_PTR, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
#: The C functions: name -> (argument types, result type)
_SIGNATURES = {
    "shardscale_supports": ([_INT], _INT),  # dtype code
    # -1 ask / 0 off / 1 on -> whether the float16/bfloat16 AVX-512 loops are in use (tests)
    "shardscale_avx512": ([_INT], _INT),
    # ptrs, lens, k, dtype, inv_scale*, found_inf*, threads -> 0, or 1 (overlap) / -1 (no
    # memory) with nothing written
    "shardscale_unscale": ([_PTR, _PTR, _I64, _INT, _PTR, _PTR, _INT], _INT),
    # the same, its arguments packed in one int64 array (one ctypes conversion, not seven)
    "shardscale_unscale_packed": ([_PTR], _INT),
    # ptrs, lens, k, dtype, p code, out*, threads -> 0 or -1
    "shardscale_norms": ([_PTR, _PTR, _I64, _INT, _INT, _PTR, _INT], _INT),
}


@dataclass(frozen=True)
class _Fns:
    unscale: Any
    norms: Any
    unscale_packed: Any = None
    avx512: Any = None  # shardscale_avx512 (tests)


_lock = threading.Lock()
_forced_torch = False  # set by torch_kernel(): benchmarks compare both kernels in one process
_loaded: tuple[KernelStatus, _Fns | None, frozenset[int]] | None = None


def _mode() -> str:
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"{ENV}={mode!r}: use 'auto' (default), '0' (torch's kernel) or '1'")
    return mode


def _cache_dirs() -> list[tuple[Path, bool]]:
    """Where to keep the library, in order: ``(directory, in a shared parent)``. The user's cache
    (``$SHARDSCALE_CACHE_DIR``, else ``$XDG_CACHE_HOME/shardscale``, else
    ``~/.cache/shardscale``; skipped without a home directory), then ``<tmp>/shardscale-<uid>``,
    whose parent others can write (no symlink accepted there)."""
    dirs: list[tuple[Path, bool]] = []
    explicit = os.environ.get(CACHE_ENV)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if explicit:  # "~" expanded, relative to the working directory as given
        try:
            dirs.append((Path(explicit).expanduser().resolve(), False))
        except (RuntimeError, KeyError):  # "~" without a home directory
            pass
    elif xdg and Path(xdg).is_absolute():  # a relative one is ignored, as the XDG spec says
        dirs.append((Path(xdg) / "shardscale", False))
    else:
        try:
            dirs.append((Path.home() / ".cache" / "shardscale", False))
        except (RuntimeError, KeyError):  # no $HOME and no passwd entry (containers)
            pass
    dirs.append((Path(tempfile.gettempdir()) / f"shardscale-{_uid()}", True))
    return dirs


def _compiler(spec: LibSpec = KERNEL) -> list[str] | None:
    env, names = spec.compilers
    cc = os.environ.get(env)
    if cc:
        return shlex.split(cc)
    for name in names:
        path = shutil.which(name)
        if path:
            return [path]
    return None


def _uid() -> int:
    return os.getuid() if hasattr(os, "getuid") else 0


def _private(path: Path, shared_parent: bool) -> bool:
    """Owned by this user and not writable by group or others, so nobody else can have planted
    or can change a library there (POSIX; always True elsewhere). In a shared parent (the temp
    dir) a symlink is refused: another user could have made it, and could re-point it."""
    if not hasattr(os, "getuid"):
        return True
    st = path.lstat() if shared_parent else path.stat()
    if stat.S_ISLNK(st.st_mode):
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _key(cc: list[str], spec: LibSpec = KERNEL) -> str:
    """The cache key: a hash of the source, the compiler (command and version), the flags,
    ``spec.key`` and the platform.

    Raises:
        CpuKernelError: the compiler does not run.
    """
    try:
        version = subprocess.run(
            [*cc, "--version"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise CpuKernelError(f"compiler {shlex.join(cc)!r} does not run: {e}") from e
    parts = [spec.source.read_bytes(), shlex.join(cc).encode(), version.encode()]
    parts += [" ".join(spec.flags + spec.link).encode(), spec.key]
    parts += [platform.machine().encode(), sys.platform.encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _compile(cc: list[str], out: str, spec: LibSpec = KERNEL) -> None:
    """Compile ``spec.source`` (by default ``_cpukernel.c``) into ``out``.

    Raises:
        CpuKernelError: the compiler failed, wrote nothing, or timed out (then it is killed with
            the processes it started, e.g. ``cc1``); its output is in the message.
    """
    command = [*cc, *spec.flags, str(spec.source), "-o", out, *spec.link]
    shown = shlex.join([*cc, *spec.flags, str(spec.source)])
    try:
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=hasattr(os, "killpg"),
        )
    except OSError as e:
        raise CpuKernelError(f"{shown} failed: {e}") from e
    try:
        stdout, stderr = proc.communicate(timeout=_BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, signal.SIGKILL)
        else:  # pragma: no cover - Windows
            proc.kill()
        proc.communicate()
        raise CpuKernelError(f"{shown} timed out after {_BUILD_TIMEOUT_S} s") from e
    if proc.returncode != 0:
        raise CpuKernelError(f"{shown} failed:\n{(stderr or stdout).strip()}")
    if os.path.getsize(out) == 0:
        raise CpuKernelError(
            f"{shown} exited 0 but wrote nothing: is ${spec.compilers[0]} a compiler?"
        )


def _digest(path: Path | str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _usable_dirs() -> Iterator[Path]:
    """The cache directories that exist (created if needed) and are private (see _private)."""
    for cache, shared in _cache_dirs():
        try:
            cache.mkdir(mode=0o700, parents=True, exist_ok=True)
            if _private(cache, shared):
                yield cache
        except OSError:
            continue


def _build_and_load(spec: LibSpec = KERNEL) -> tuple[Path, ctypes.CDLL]:
    """The compiled library (``spec``, by default the kernel), loaded: from the cache, else
    compiled into it.

    First every private cache directory (:func:`_cache_dirs`; one owned by another user or
    writable by others is never used) is searched for the library, loaded only if its recorded
    SHA-256 matches (a truncated or damaged file would crash ``dlopen`` with SIGBUS). Otherwise
    it is compiled into the first directory where the fresh build loads (a ``noexec`` mount is
    passed over), then installed atomically with its checksum (ranks building at once each
    install a whole file).

    Raises:
        CpuKernelError: no compiler, it failed, or no directory where the library loads.
    """
    cc = _compiler(spec)
    if cc is None:
        raise CpuKernelError(
            f"no compiler found (set ${spec.compilers[0]}, or install {spec.install})"
        )
    name = f"{spec.prefix}-{_key(cc, spec)}.so"
    load = spec.loader or ctypes.CDLL
    for cache in _usable_dirs():
        lib, sha = cache / name, cache / (name + ".sha256")
        try:
            if _private(lib, True) and _private(sha, True) and sha.read_text() == _digest(lib):
                return lib, load(str(lib))
        except OSError:
            continue  # missing, unreadable, or does not load here: (re)built below
    problems: list[str] = []
    for cache in _usable_dirs():
        lib, sha = cache / name, cache / (name + ".sha256")
        try:
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
            os.close(fd)
        except OSError as e:
            problems.append(f"{cache}: {e}")
            continue
        try:
            logger.info(
                "shardscale: compiling %s into %s (once per version, then cached)",
                spec.source.name,
                cache,
            )
            _compile(cc, tmp, spec)
            try:
                loaded = load(tmp)
            except OSError as e:
                problems.append(f"{cache}: the library does not load there ({e})")
                continue
            digest = _digest(tmp)
            os.replace(tmp, lib)
            fd, tmp_sha = tempfile.mkstemp(suffix=".sha256", dir=cache)
            with os.fdopen(fd, "w") as f:
                f.write(digest)
            os.replace(tmp_sha, sha)
            return lib, loaded
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise CpuKernelError(
        f"no private cache directory where the library loads (set ${CACHE_ENV}): "
        + ("; ".join(problems) or "none usable: " + ", ".join(str(d) for d, _ in _cache_dirs()))
    )


def _load() -> tuple[KernelStatus, _Fns | None, frozenset[int]]:
    global _loaded
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        mode = _mode()
        if mode == "0":
            _loaded = (KernelStatus(False, f"{ENV}=0"), None, frozenset())
            return _loaded
        try:
            path, lib = _build_and_load()
        except Exception as e:  # auto: anything that stops the build means torch's kernels
            if mode == "1":
                raise CpuKernelError(f"{ENV}=1 but the CPU kernel is unavailable: {e}") from e
            logger.info("shardscale: compiled CPU kernel unavailable, using torch's: %s", e)
            _loaded = (KernelStatus(False, str(e)), None, frozenset())
            return _loaded
        for name, (args, result) in _SIGNATURES.items():
            getattr(lib, name).argtypes, getattr(lib, name).restype = args, result
        codes = frozenset(c for c in _CODES.values() if lib.shardscale_supports(c))
        dtypes = tuple(d for d, c in _CODES.items() if c in codes)
        fns = _Fns(
            lib.shardscale_unscale,
            lib.shardscale_norms,
            lib.shardscale_unscale_packed,
            lib.shardscale_avx512,
        )
        _loaded = (KernelStatus(True, str(path), dtypes), fns, codes)
        return _loaded


def status() -> KernelStatus:
    """Build or load the kernel if not done yet, and say whether CPU unscales use it.

    Raises:
        CpuKernelError: ``SHARDSCALE_CPU_KERNEL=1`` and the kernel cannot be built.
        ValueError: ``SHARDSCALE_CPU_KERNEL`` is not ``auto``, ``0`` or ``1``.
    """
    return _load()[0]


def reset() -> None:
    """Forget the loaded kernel, so the next call reads ``SHARDSCALE_CPU_KERNEL`` again (tests)."""
    global _loaded
    with _lock:
        _loaded = None


@contextlib.contextmanager
def torch_kernel() -> Iterator[None]:
    """Within this block, CPU unscales use torch's kernel even where the compiled one is loaded
    (``shardscale bench`` times both side by side). Not thread-safe; not for training code: set
    ``SHARDSCALE_CPU_KERNEL=0`` instead."""
    global _forced_torch
    before, _forced_torch = _forced_torch, True
    try:
        yield
    finally:
        _forced_torch = before


def _channels_last(t: torch.Tensor) -> bool:
    """Whether ``t`` is channels-last (2d or 3d): its elements then fill ``numel`` consecutive
    slots from ``data_ptr()``, as a contiguous tensor's do, so an elementwise kernel or a norm
    may treat it as one flat array."""
    return t.dim() in (4, 5) and t.is_contiguous(
        memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d
    )


def _scalar_ptr(t: torch.Tensor) -> int:
    """The address of ``t``'s element if it is a plain 0-d (or 1-element) float32 CPU tensor
    with real storage (not a FakeTensor or a wrapper subclass, whose ``data_ptr()`` is not its
    data), else 0."""
    if type(t) is torch.Tensor and t.dtype is torch.float32 and t.is_cpu and t.numel() == 1:
        return t.data_ptr()
    return 0


class Batch:
    """CPU tensors of one dtype, split as they are added between the compiled kernel and torch's.

    Bucketing fills one per CPU dtype in its single pass over the gradients
    (:func:`shardscale._grads.bucket_grads`), so the kernel's pointer and length arrays cost no
    second pass. ``taken``: plain CPU tensors (not subclasses: a wrapper's ``data_ptr()`` is not
    its data) of exactly ``dtype``, dense (contiguous or channels-last), non-empty and aligned to
    their element size (for writes, at most ``_SMALL_CAP`` of them with under ``_SMALL``
    elements: for many small tensors torch's one foreach call is cheaper than our Python per
    tensor); their addresses in ``ptrs`` and element counts in ``lens``. ``rest``: everything
    else, in the order added (all of it when the kernel is not loaded or has no path for
    ``dtype``), then any moved there by :meth:`drop_overlaps`.

    The addresses are read when a tensor is added: a tensor whose storage is replaced before
    the kernel runs (``.set_()``, ``.data =``) must be added again (:meth:`regathered`).
    """

    __slots__ = ("dtype", "ptrs", "lens", "taken", "rest", "_esize", "_small_left", "_on", "_fns")

    def __init__(self, dtype: torch.dtype, writes: bool = True) -> None:
        _, fns, codes = _loaded if _loaded is not None else _load()
        self.dtype = dtype
        self.ptrs = array("q")
        self.lens = array("q")
        self.taken: list[torch.Tensor] = []
        self.rest: list[torch.Tensor] = []
        self._esize = dtype.itemsize
        self._small_left = _SMALL_CAP if writes else -1  # -1: no limit
        self._on = fns is not None and _CODES.get(dtype) in codes
        self._fns = fns

    @classmethod
    def gathered(
        cls,
        dtype: torch.dtype,
        taken: list[torch.Tensor],
        ptrs: array,
        lens: array,
        rest: list[torch.Tensor],
        small_left: int,
    ) -> Batch:
        """A batch for writes whose tensors were split, as :meth:`add` would split them, by
        ``_gather.cpp`` (:mod:`shardscale._gather`)."""
        batch = cls(dtype)
        batch.taken, batch.ptrs, batch.lens, batch.rest = taken, ptrs, lens, rest
        batch._small_left = small_left
        return batch

    def add(self, t: torch.Tensor, numel: int) -> None:
        """Add ``t`` (``numel``: its ``numel()``, which the caller has read already)."""
        if (
            numel
            and type(t) is torch.Tensor
            and t.dtype is self.dtype
            and t.is_cpu
            and t.layout is torch.strided
        ):
            self.add_dense(t, numel)
        else:
            self.rest.append(t)

    def add_dense(self, t: torch.Tensor, numel: int) -> None:
        """:meth:`add` for a tensor the caller has checked is a plain (``type(t) is
        torch.Tensor``), strided CPU tensor of ``dtype`` with ``numel > 0`` elements (bucketing
        calls it directly): it reads only what is left to check (layout in memory, address)."""
        if (
            self._on
            and (numel >= _SMALL or self._small_left)
            and (t.is_contiguous() or _channels_last(t))
        ):
            ptr = t.data_ptr()
            if ptr and not ptr % self._esize:
                if numel < _SMALL and self._small_left > 0:
                    self._small_left -= 1
                self.ptrs.append(ptr)
                self.lens.append(numel)
                self.taken.append(t)
                return
        self.rest.append(t)

    def regathered(self) -> Batch:
        """A new batch of the same tensors, their addresses read again."""
        batch = Batch(self.dtype, writes=self._small_left != -1)
        for t in self.tensors:
            batch.add(t, t.numel())
        return batch

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor added: ``taken`` then ``rest``."""
        return self.taken + self.rest

    def drop_overlaps(self) -> None:
        """Move taken tensors whose memory overlaps another taken one's to ``rest`` (threads
        writing both would race; torch's kernel then handles them one by one). Run when the
        kernel refused the batch for it (it checks before writing anything)."""
        if len(self.taken) < 2:
            return
        clash = _overlapping(self.ptrs, self.lens, self._esize)
        if clash:
            keep = [i for i in range(len(self.taken)) if i not in clash]
            self.rest += [self.taken[i] for i in sorted(clash)]
            self.ptrs = array("q", [self.ptrs[i] for i in keep])
            self.lens = array("q", [self.lens[i] for i in keep])
            self.taken = [self.taken[i] for i in keep]


def _flat(grads: list[torch.Tensor], dtype: torch.dtype, writes: bool) -> Batch:
    """``grads`` split for the kernel (:class:`Batch`)."""
    batch = Batch(dtype, writes)
    for g in grads:
        batch.add(g, g.numel())
    return batch


def _overlapping(ptrs: array, lens: array, esize: int) -> set[int]:
    """Indices of the memory ranges ``[ptr, ptr + len * esize)`` that overlap another one."""
    clash: set[int] = set()
    reach, owner = -1, -1  # the furthest end so far, and whose it is
    for i in sorted(range(len(ptrs)), key=ptrs.__getitem__):
        if ptrs[i] < reach:
            clash.update((i, owner))
        end = ptrs[i] + lens[i] * esize
        if end > reach:
            reach, owner = end, i
    return clash


def unscale_batch_(batch: Batch, found_inf: torch.Tensor, factor: torch.Tensor) -> None:
    """Multiply ``batch``'s tensors by ``factor`` in place and set ``found_inf`` to 1.0 if one
    holds inf or NaN: the compiled kernel over ``taken`` (one call; a second after it refused
    overlapping memory), torch's
    ``_amp_foreach_non_finite_check_and_unscale_`` over the rest. Arguments as
    :func:`foreach_unscale_`; tensors' version counters are left alone, as torch's kernel does."""
    _, rest = _unscale(batch, found_inf, factor)
    if rest:
        with torch.no_grad():
            torch._amp_foreach_non_finite_check_and_unscale_(rest, found_inf, factor)


def _unscale(
    batch: Batch, found_inf: torch.Tensor, factor: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Run the compiled unscale on what ``batch`` lets it take; return ``(taken, rest)``: what
    it wrote and what is left for torch's kernel."""
    if not batch.taken:
        return [], batch.rest
    flag, inv = _scalar_ptr(found_inf), _scalar_ptr(factor)
    if _forced_torch or not (flag and inv):
        return [], batch.tensors
    unscale = batch._fns.unscale_packed  # type: ignore[union-attr]  # loaded: taken is not empty
    tail = (_CODES[batch.dtype], inv, flag, torch.get_num_threads())
    for attempt in range(2):
        # shardscale_unscale's seven arguments in one int64 array: one ctypes conversion
        args = array("q", (batch.ptrs.buffer_info()[0], batch.lens.buffer_info()[0]))
        args.extend((len(batch.taken), *tail))
        rc = unscale(args.buffer_info()[0])
        if rc == 0:
            return batch.taken, batch.rest
        if rc < 0 or attempt:  # out of memory, or refused again: nothing written either way
            break
        batch.drop_overlaps()  # refused, nothing written: memory shared by two tensors
    return [], batch.tensors


def foreach_unscale_(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """``torch._amp_foreach_non_finite_check_and_unscale_`` for CPU tensors, compiled where possible.

    Args:
        grads: CPU tensors of a floating dtype; multiplied by ``inv_scale`` in place (not
            written at all when it is 1.0).
        found_inf: 0-d float32 CPU tensor; set to 1.0 if any element is inf or NaN, else left.
        inv_scale: 0-d float32 CPU tensor.

    Dense (contiguous or channels-last) plain tensors of the first tensor's dtype, float32,
    bfloat16 or float16, go through the compiled kernel (one call, all threads of
    ``torch.get_num_threads()``), the rest (subclasses, other layouts and dtypes) through torch's
    kernel. Same results as torch's kernel bit for bit on every non-NaN element; like it, the
    tensors' version counters are left alone.
    """
    if grads:
        unscale_batch_(_flat(grads, grads[0].dtype, writes=True), found_inf, inv_scale)


#: The found-inf flag of a multiply: written (by any thread), never read
_IGNORED_FLAG = torch.zeros((), dtype=torch.float32, device="cpu")


def foreach_mul_(grads: list[torch.Tensor], factor: torch.Tensor) -> None:
    """``torch._foreach_mul_(grads, factor)`` for CPU tensors and a 0-d float32 CPU ``factor``,
    through the compiled kernel where possible: the same bits (each element widened to float32,
    multiplied, rounded to nearest-even; nothing written when ``factor`` is 1) and, as torch's,
    the tensors' version counters bumped. The rest goes through ``torch._foreach_mul_``."""
    if not grads:
        return
    batch = _flat(grads, grads[0].dtype, writes=True)
    taken, rest = _unscale(batch, _IGNORED_FLAG, factor)
    if taken:
        try:
            torch.autograd.graph.increment_version(taken)
        except TypeError:  # torch < 2.8 takes one tensor at a time
            for t in taken:
                torch.autograd.graph.increment_version(t)
    if rest:
        torch._foreach_mul_(rest, factor)


#: norm_type -> the kernel's code (0: the inf-norm)
_P_CODES = {2.0: 2, 1.0: 1, math.inf: 0}


def foreach_norm(grads: list[torch.Tensor], p: float) -> torch.Tensor | None:
    """Per-tensor p-norms of CPU tensors of one dtype, computed in float64, or None.

    Returns:
        A 1-d float64 CPU tensor of ``len(grads)`` norms (NaN for a tensor holding a NaN, else
        inf for one holding an inf, as torch's norms), from one read of each tensor, all threads
        of ``torch.get_num_threads()``. Squares are exact in float64 and their sum neither
        overflows nor underflows there, so a loss scale cannot change the result's finiteness.
        None when the compiled kernel is not loaded, ``p`` is not 1, 2 or inf, the dtype has no
        compiled path or a tensor is not one the kernel takes (plain, dense, aligned, non-empty,
        of the first one's dtype): the caller then uses torch's norms.
    """
    _, fns, codes = _load()
    code = _P_CODES.get(float(p))
    if fns is None or _forced_torch or code is None or not grads:
        return None
    dtype = grads[0].dtype
    if _CODES.get(dtype) not in codes:
        return None
    batch = _flat(grads, dtype, writes=False)
    if batch.rest:
        return None
    k = len(batch.taken)
    out = torch.empty(k, dtype=torch.float64, device="cpu")
    rc = fns.norms(
        batch.ptrs.buffer_info()[0],
        batch.lens.buffer_info()[0],
        k,
        _CODES[dtype],
        code,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out if rc == 0 else None
