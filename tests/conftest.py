"""Session set-up shared by every test module."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def _compiled_cpu_parts_built_once() -> None:
    """Build (or load from the cache) the CPU kernel and the C++ gathering before any test: the
    2-rank tests fork from this process and inherit them, instead of each rank building at once
    on a fresh machine (~20 s, inside their collective timeouts)."""
    from shardscale import _gather

    _gather.status()
