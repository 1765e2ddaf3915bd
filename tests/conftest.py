"""Each test states its device.

[Note: CPU tests stay on the CPU on a GPU host]
The suite's worlds are gloo worlds on the CPU, and its single-process tests feed CPU batches.  On a
host with a GPU (where pip's torch is the CUDA build) a lone process would pick ``cuda:0`` and those
tests would mix devices.  So the suite hides the GPUs from itself (``CUDA_VISIBLE_DEVICES=""``, set
before anything asks torch about CUDA, and inherited by every rank it starts), and a test that needs
the GPU is marked ``@pytest.mark.cuda``: it runs its ranks in a subprocess given the original
``CUDA_VISIBLE_DEVICES`` (:func:`cuda_env`), and is skipped where the host has no NVIDIA device.
"""

import glob
import os
import sys

# The spawned ranks import the helper modules next to the tests by name.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "distributed"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

#: the host's own setting, for the tests marked ``cuda`` (None: unset, every device visible)
HOST_CUDA_VISIBLE_DEVICES = os.environ.get("CUDA_VISIBLE_DEVICES")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402


def host_has_cuda() -> bool:
    """Whether the host has an NVIDIA device and torch was built for CUDA (asked without initialising
    CUDA in this process, whose devices are hidden)."""
    import torch

    return torch.version.cuda is not None and bool(glob.glob("/dev/nvidia[0-9]*")) \
        and HOST_CUDA_VISIBLE_DEVICES not in ("", "-1")


def cuda_env() -> dict[str, str]:
    """The environment for a subprocess that uses the GPU: this one with the host's devices visible."""
    env = dict(os.environ)
    if HOST_CUDA_VISIBLE_DEVICES is None:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = HOST_CUDA_VISIBLE_DEVICES
    return env


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Extended tests (``@pytest.mark.slow``) run in CI (``CI=true``) or with ``ZEROSHARD_EXTENDED=1``;
    a plain local ``bash test.sh`` skips them, saying how to run them.  Soak and crash sweeps
    (``@pytest.mark.nightly``) run only with
    ``ZEROSHARD_NIGHTLY=1``: CI runs them in a step of their own after the suite (``.ci/run``).  Tests
    marked ``cuda`` run only where the host has a GPU."""
    extended = os.environ.get("CI", "").lower() == "true" or os.environ.get("ZEROSHARD_EXTENDED") == "1"
    nightly = os.environ.get("ZEROSHARD_NIGHTLY") == "1"
    skip_slow = pytest.mark.skip(reason="extended test: runs in CI (CI=true) or with ZEROSHARD_EXTENDED=1")
    skip_nightly = pytest.mark.skip(reason="soak or crash sweep: runs with ZEROSHARD_NIGHTLY=1 (CI's second step)")
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device (and torch built for CUDA)")
    has_cuda = host_has_cuda()
    for item in items:
        if "nightly" in item.keywords:
            if not nightly:
                item.add_marker(skip_nightly)
        elif "slow" in item.keywords and not extended:
            item.add_marker(skip_slow)
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(skip_cuda)
