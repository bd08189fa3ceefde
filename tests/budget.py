"""Hypothesis example budgets.

Each test names its count for the derandomized ``ci`` profile;
``HYPOTHESIS_PROFILE=dev`` multiplies every count by ten to explore more.
"""

import os

SCALE = 10 if os.environ.get("HYPOTHESIS_PROFILE") == "dev" else 1


def examples(count: int) -> int:
    """The number of examples a test with ``count`` in CI runs under the active profile."""
    return count * SCALE
