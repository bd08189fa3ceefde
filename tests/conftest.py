"""Test settings: hypothesis profiles, the Triton interpreter on CPU, the ``gpu`` marker, and work started at
collection that runs beside the suite.

Profiles: ``ci`` (default) is derandomized so that a landing never flakes;
``dev`` explores more, with fresh random examples and ten times each test's
count (``tests/budget.py``): ``HYPOTHESIS_PROFILE=dev python -m pytest -q``.
"""

import os

import pytest
import torch

# The Triton backend runs on CPU through the interpreter; it must be chosen
# before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=500,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(items):
    """Every test of a ``test_*_gpu.py`` module carries the ``gpu`` marker (``pytest -m gpu``, ``-m "not gpu"``)."""
    for item in items:
        if item.path.name.endswith("_gpu.py"):
            item.add_marker(pytest.mark.gpu)


def pytest_collection_finish(session):
    """Start the work of collected modules that runs in processes of its own (``start_in_background``: the
    sm_90 compiles of ``test_kernels_compile.py``), so that it overlaps the rest of the suite."""
    for module in {item.module for item in session.items if getattr(item, "module", None) is not None}:
        if hasattr(module, "start_in_background"):
            module.start_in_background()
