"""Test settings: hypothesis profiles, the Triton interpreter on CPU, and the ``gpu`` marker.

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

import sm90_processes  # noqa: E402

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
    """Start the sm_90 compile now if the session runs its tests, so that it overlaps the tests before them."""
    if any(item.path.name == sm90_processes.MODULE for item in session.items):
        sm90_processes.start()


def pytest_sessionfinish(session):
    """Stop the sm_90 compile if its tests did not run to read it (a session stopped early)."""
    sm90_processes.stop()
