"""Bucketing the common case's CPU gradients in C++ (``_gather.cpp``): one call per step.

Right after a backward pass has streamed through the caches, Python is slow: the interpreter's
own state is cold, and :func:`shardscale._grads.bucket_grads`' loop costs ~5 us per parameter
(~115 us for the 22 tensors of a GPT-2-small-shaped set, ~9 % of a 10M-element float32
unscale). ``_gather.cpp`` does the same reads on the tensors themselves, through torch's C++
API, for ~2 us per parameter. It handles the common case only (every parameter a plain
``nn.Parameter``, listed once, its gradient None or a plain dense CPU tensor of a dtype the
kernel has a path for) and answers None for anything else: the Python path then runs as before.

For the commonest case (one dtype, every gradient dense and aligned, so the kernel takes them
all) :func:`unscale_` goes further: the same C++ call runs the kernel (``_cpukernel.c``'s
``shardscale_unscale_packed``, by address) on what it gathered, so a CPU ``unscale_`` is one
call from the optimizer's param groups to the found-inf flag, with no Python objects made for
the gradients (it reads whether a gradient has a Python subclass object without creating one).

It is built at first use against the installed torch's headers (``$CXX``, else ``c++``/``g++``/
``clang++``; ~15-25 s, once per torch version) and cached beside the CPU kernel
(:mod:`shardscale._cpukernel`, same directories and checks). Where it cannot be built (no C++
compiler, no Python or torch headers) the Python path is used, logged once at INFO on the
``shardscale`` logger. ``SHARDSCALE_CPU_KERNEL=0`` turns it off with the kernel;
``SHARDSCALE_CPU_GATHER=0`` turns off only this.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import sysconfig
import threading
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from . import _cpukernel
from ._cpukernel import CPU as _CPU
from ._cpukernel import Batch

logger = logging.getLogger("shardscale")

ENV = "SHARDSCALE_CPU_GATHER"
_SOURCE = Path(__file__).with_name("_gather.cpp")
#: dtype code (``_cpukernel._CODES``) -> dtype
_DTYPES = {code: dtype for dtype, code in _cpukernel._CODES.items()}
#: ``_gather.cpp``'s ctx: the exact types it accepts, and the array type it returns
_CTX = (torch.nn.Parameter, torch.Tensor, array)
#: Whether a ``__torch_function__`` mode is active (None in a torch without it: never gather)
_mode_on = getattr(torch._C, "_is_torch_function_mode_enabled", None)

_lock = threading.Lock()
_fn: Any = None  # the loaded function; False: unavailable
_unscale_fn: Any = None  # shardscale_gather_unscale, loaded with _fn
_unscale_ctx: tuple[Any, tuple[Any, ...]] | None = None  # (the kernel's functions, the ctx)
_reason = ""  # why not, or the library's path
_masks: dict[frozenset[int], int] = {}  # the kernel's dtype codes -> the bit mask the C++ takes
_off = False  # set by python_path()


def _spec() -> _cpukernel.LibSpec:
    """How to build ``_gather.cpp``: against this torch's headers and libraries, this Python's
    headers, and torch's C++ ABI (the key carries torch's version and build)."""
    torch_dir = Path(torch.__file__).resolve().parent
    lib_dir = torch_dir / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = (
        "-O2",
        "-DNDEBUG",  # as torch is built: its headers' debug-only checks stay out
        "-std=c++20",
        "-shared",
        "-fPIC",
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{sysconfig.get_paths()['include']}",
        f"-I{torch_dir / 'include'}",
        f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
    )
    link = (f"-L{lib_dir}", "-ltorch_python", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib_dir}")
    key = "\0".join((torch.__version__, str(torch.version.git_version), sys.version)).encode()
    return _cpukernel.LibSpec(
        "gather",
        _SOURCE,
        compilers=("CXX", ("c++", "g++", "clang++")),
        flags=flags,
        link=link,
        key=key,
        loader=ctypes.PyDLL,
        install="g++",
    )


def _load() -> Any:
    """The C++ function, built or loaded at the first call; False where unavailable."""
    global _fn, _reason
    if _fn is not None:
        return _fn
    with _lock:
        if _fn is not None:
            return _fn
        kernel, fns, _ = _cpukernel._load()
        if fns is None:
            _fn, _reason = False, f"no CPU kernel ({kernel.reason})"
            return _fn
        if os.environ.get(ENV, "auto").strip() == "0":
            _fn, _reason = False, f"{ENV}=0"
            return _fn
        if not sys.platform.startswith("linux"):
            _fn, _reason = False, "built on Linux only"
            return _fn
        try:
            path, lib = _cpukernel._build_and_load(_spec())
        except Exception as e:  # anything that stops the build means the Python path
            logger.info("shardscale: C++ gradient gathering unavailable, using Python's: %s", e)
            _fn, _reason = False, str(e)
            return _fn
        fn = lib.shardscale_gather
        fn.argtypes = [ctypes.py_object, ctypes.py_object] + [ctypes.c_longlong] * 3
        fn.restype = ctypes.py_object
        global _unscale_fn
        _unscale_fn = lib.shardscale_gather_unscale
        _unscale_fn.argtypes = [ctypes.py_object] * 4
        _unscale_fn.restype = ctypes.c_int
        _fn, _reason = fn, str(path)
        return _fn


def status() -> tuple[bool, str]:
    """Build or load it if not done yet: ``(in use, the library's path or why not)``."""
    return bool(_load()), _reason


def reset() -> None:
    """Forget the loaded function, so the next call loads it again (tests)."""
    global _fn, _unscale_fn, _unscale_ctx
    with _lock:
        _fn = _unscale_fn = _unscale_ctx = None


@contextlib.contextmanager
def python_path() -> Iterator[None]:
    """Within this block, gradients are gathered by the Python path (tests compare both).
    Not thread-safe; not for training code: set ``SHARDSCALE_CPU_GATHER=0``."""
    global _off
    before, _off = _off, True
    try:
        yield
    finally:
        _off = before


def _kernel(fn: Any) -> Any:
    """``_cpukernel``'s loaded state when ``fn`` (a loaded C++ function) may run now, else None:
    not loaded, turned off by :func:`python_path`, a ``__torch_function__`` mode active (it
    could see ``param.grad``), or no compiled kernel."""
    if not fn or _off or _mode_on is None or _mode_on():
        return None
    kernel = _cpukernel._loaded or _cpukernel._load()  # tests reload the kernel
    return kernel if kernel[1] is not None else None


def gather(optimizer: torch.optim.Optimizer) -> dict[torch.device, dict[torch.dtype, Any]] | None:
    """``optimizer``'s gradients bucketed as :func:`shardscale._grads.bucket_grads` would
    (``{cpu: {dtype: Batch}}``, ``{}`` when no parameter has a gradient), or None when this is
    not the common case, the C++ library is not loaded (yet: it is built only for processes
    that have CPU gradients) or not in use, or a ``__torch_function__`` mode is active (it
    could see ``param.grad``): then take the Python path."""
    fn = _fn  # loaded by status(), which bucket_grads calls once it has made a CPU bucket
    kernel = _kernel(fn)
    if kernel is None:
        return None
    _, fns, codes = kernel
    mask = _masks.get(codes)
    if mask is None:
        mask = _masks[codes] = sum(1 << c for c in codes)
    got = fn(optimizer.param_groups, _CTX, mask, _cpukernel._SMALL, _cpukernel._SMALL_CAP)
    if got is None:
        return None
    if not got:
        return {}
    return {_CPU: {_DTYPES[code]: Batch.gathered(_DTYPES[code], *parts) for code, *parts in got}}


def unscale_(
    optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> bool | None:
    """:func:`gather` and the kernel's unscale (:func:`shardscale._cpukernel.unscale_batch_`)
    in one C++ call, for the commonest case: every gradient of one dtype, plain, dense and
    aligned (the kernel takes them all). Multiplies the gradients by ``inv_scale`` (a 0-d
    float32 CPU tensor; 1.0: check only, nothing written) and sets ``found_inf`` (a 0-d
    float32 CPU tensor) to 1.0 if one held inf or NaN.

    Returns True when done, False when no parameter has a gradient (nothing done), None when
    this is not that case (nothing written: take the Python path), as :func:`gather`."""
    fn = _unscale_fn
    kernel = _kernel(fn)
    if kernel is None or _cpukernel._forced_torch:
        return None
    _, fns, codes = kernel
    global _unscale_ctx
    cached = _unscale_ctx
    if cached is None or cached[0] is not fns:  # (tests reload the kernel)
        address = ctypes.cast(fns.unscale_packed, ctypes.c_void_p).value
        cached = _unscale_ctx = (fns, (*_CTX[:2], sum(1 << c for c in codes), address))
    rc = fn(optimizer.param_groups, cached[1], found_inf, inv_scale)
    return None if rc < 0 else rc == 0
