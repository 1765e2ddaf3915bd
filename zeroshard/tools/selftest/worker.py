"""One rank of ``zeroshard selftest``, started by torchrun (tools/selftest/command.py):

    torchrun --standalone --nproc_per_node N -m zeroshard.tools.selftest.worker SPEC.json

``SPEC.json`` says what to run (size, precision, steps) and where rank 0 writes the results.  The
sections run in turn in one world: correctness, then throughput with memory and host syncs, then
collective bandwidth.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ...distributed.world import World, init_distributed
from ...version import __version__
from . import bandwidth, fp8_case, parity, throughput
from .sizes import pick_size


def environment(world: World) -> dict[str, Any]:
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world.world_size))
    info: dict[str, Any] = {
        "zeroshard": __version__, "torch": torch.__version__, "python": platform.python_version(),
        "host": platform.node(), "cpus": os.cpu_count(), "device": world.device.type, "backend": world.backend,
        "world_size": world.world_size, "nodes": max(1, world.world_size // per_node),
        "threads": torch.get_num_threads(),
    }
    if world.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(world.device)
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(world.device).total_memory
        info["cuda"] = torch.version.cuda
    return info


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    world = init_distributed()
    if world.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 cases compare to 1e-5
        torch.backends.cudnn.allow_tf32 = False

    def say(message: str) -> None:
        if world.is_main:
            print(message, flush=True)

    preset = pick_size(spec["size"])
    say(f"selftest: {world.world_size} rank(s) on {world.device.type} ({world.backend}); model {preset.name} "
        f"({preset.num_params / 1e6:.3g}M parameters)")
    started = time.perf_counter()
    results: dict[str, Any] = {"environment": environment(world), "size": preset.name,
                               "size_params": preset.num_params, "precision": spec["precision"],
                               "steps": spec["steps"], "warmup": spec["warmup"]}
    sections: dict[str, Callable[[], Any]] = {
        "correctness": lambda: parity.run_cases(world, say) + fp8_case.run_fp8_cases(world, say),
        "throughput": lambda: throughput.run_all(preset, world, spec["precision"], spec["steps"], spec["warmup"],
                                                 say),
        "bandwidth": lambda: bandwidth.run_all(world, say),
    }
    results["sections_s"] = {}
    for name, section in sections.items():
        began = time.perf_counter()
        results[name] = section()
        results["sections_s"][name] = time.perf_counter() - began
    results["worker_s"] = time.perf_counter() - started
    if world.is_main:
        target = Path(spec["results"])
        partial = target.with_suffix(".partial")
        partial.write_text(json.dumps(results, indent=1))
        partial.replace(target)  # whole or absent: the command never reads half a file


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: torchrun ... -m zeroshard.tools.selftest.worker SPEC.json (run `zeroshard selftest`)")
    main(sys.argv[1])
