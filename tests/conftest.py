import os
import sys

# The spawned ranks import the helper modules next to the tests by name.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "distributed"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Extended tests (``@pytest.mark.slow``) run in CI (``CI=true``) or with ``ZEROSHARD_EXTENDED=1``;
    a plain local ``bash test.sh`` skips them, saying how to run them."""
    if os.environ.get("CI", "").lower() == "true" or os.environ.get("ZEROSHARD_EXTENDED") == "1":
        return
    skip = pytest.mark.skip(reason="extended test: runs in CI (CI=true) or with ZEROSHARD_EXTENDED=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
