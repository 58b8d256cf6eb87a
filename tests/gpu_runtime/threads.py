"""One autouse fixture shared by the runtime test packages that run tiny models on the CPU.

A conftest opts in with `from tests.gpu_runtime.threads import one_cpu_thread  # noqa: F401`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def one_cpu_thread() -> Iterator[None]:
    """Tiny matmuls run several times faster on one thread of a shared 2-core machine."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
