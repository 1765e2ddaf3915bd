"""Offload (CPU and NVMe) must not change the mathematics: fp32 runs equal non-offloaded runs bitwise.

Covered: optimizer offload to host memory and to NVMe at stages 1-3, worlds 1-3, with sub-groups
smaller than a bucket (odd sizes) and gradient accumulation; stage-3 parameter offload (cpu, nvme,
and nvme beyond ``max_in_cpu``; cpu without optimizer offload, with and without an optimizer); AdamW
with amsgrad under NVMe offload against torch's; checkpoints that resume exactly into another offload
setting; swap files removed or a full disk (clear errors); the pre-flight checks; and the breakdown by
place.

One world per world size runs its cases in turn (``run_family``), each from the same seed, in a
directory of its own, with engines it closes; the test then checks every case, and a failure names
the case: its check, stage, world size, precision and arguments.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import zeroshard
from zs_common import (clone, make_model, max_rel_diff, rank_micro_batches, single_process_reference, train_ddp,
                       zero_config)

from zeroshard.planning.estimator import EstimateRequest, estimate_stage
from zeroshard.offload import OffloadIOError, OffloadPreflightError
from zeroshard.tools.testing import Case, case_directory, check_family, run_family

SUB_GROUP = 700  # smaller than most buckets and no divisor of them: pieces of odd sizes

def offload_config(stage: int, nvme: str, optimizer: str = "none", param: str = "none",
                   host_page_reuse: bool = True, **extra) -> dict:
    zero = {"stage3_param_persistence_threshold": 20, "sub_group_size": SUB_GROUP,
            "offload_optimizer": {"device": optimizer, "nvme_path": nvme}, "host_page_reuse": host_page_reuse}
    if param != "none":
        zero["offload_param"] = {"device": param, "nvme_path": nvme, "max_in_cpu": 600}
    return {**zero_config(stage, 1, 2, **zero), **extra}


def train(engine, rank: int, world: int, steps: range) -> None:
    for step in steps:
        for x, y in rank_micro_batches(step, rank, world, 1, 2):
            engine.backward(engine(x, y))
            engine.step()


def full_params(model) -> dict[str, torch.Tensor]:
    with zeroshard.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def parity_worker(rank: int, world: int, nvme: str, stage: int, host_page_reuse: bool = True) -> dict:
    variants = [("none", "none"), ("cpu", "none"), ("nvme", "none")]
    if stage == 3:
        variants += [("cpu", "cpu"), ("nvme", "nvme"), ("cpu", "nvme")]
    if not host_page_reuse:  # the GPU's path: parameter shards kept on the device, in host memory, on NVMe
        variants = [("none", "none"), ("cpu", "cpu"), ("nvme", "nvme")]
    out, reference = {}, None
    for optimizer, param in variants:
        model = make_model()
        config = offload_config(stage, nvme, optimizer, param, host_page_reuse)
        engine, _, _, _ = zeroshard.initialize(model=model, config=config)
        train(engine, rank, world, range(4))
        params = full_params(model)
        if reference is None:
            reference = params
        mb = engine.memory_breakdown()
        layout = engine.strategy.layout  # the trainable buckets
        persistent = engine.strategy.plan.persistent_buckets if stage == 3 else frozenset()
        out[f"{optimizer}/{param}"] = {
            "equal": all(torch.equal(reference[k], params[k]) for k in params),
            "parked": mb.get("parked_pages", 0),
            "mb": {k: mb[k] for k in ("optimizer", "params", "grads", "model_states", "on_device", "on_host",
                                      "on_nvme", "formula")},
            # real (unpadded) elements: the model's, this rank's share, and its share of persistent buckets
            "psi": layout.numel, "own": layout.real_numel_in_shard(rank),
            "own_persistent": sum(b.real_numel_in_shard(rank) for b in layout.buckets if b.index in persistent),
        }
        engine.close()
    return out


def params_alone_worker(rank: int, world: int, nvme: str, stage: int) -> dict:
    """``offload_param: cpu`` without ``offload_optimizer`` (ZeRO-Inference): an engine without an
    optimizer built under ``Init``, and one that trains (masters and optimizer state on the device)."""
    x, _ = rank_micro_batches(0, rank, world, 1, 2)[0]
    with torch.no_grad():
        expected = make_model()(x)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": stage, "stage3_param_persistence_threshold": 20, "offload_param": {"device": "cpu"}}}
    with zeroshard.Init(config=config):
        model = make_model()
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    with torch.no_grad():
        logits = engine(x)
    engine.close()
    model = make_model()
    engine, _, _, _ = zeroshard.initialize(model=model, config=offload_config(stage, nvme, "none", "cpu"))
    train(engine, rank, world, range(3))
    mb = engine.memory_breakdown()
    out = {"logits": logits, "expected": expected, "params": full_params(model),
           "mb": {k: mb[k] for k in ("optimizer", "params", "grads", "model_states", "formula", "on_device", "on_host",
                                     "on_nvme")}}
    engine.close()
    return out


def check_parameters_alone_offloaded_compute_and_train_as_one_process(results: list[dict], directory: Path,
                                                                       stage: int) -> None:
    """Forwards with the shards in host memory equal the plain model's; training equals one process on
    the global batch, the shards in host memory and the optimizer's masters and state on the device."""
    reference = single_process_reference(3, len(results), 1, 2)
    # fp32 masters (4 bytes) beside Adam's moments: the formula with 12 bytes of optimizer state
    assert sum(r["mb"]["model_states"] for r in results) == pytest.approx(len(results) * results[0]["mb"]["formula"])
    for r in results:
        torch.testing.assert_close(r["logits"], r["expected"], rtol=0, atol=0)
        for name, value in r["params"].items():
            torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6, msg=name)
        mb = r["mb"]
        assert mb["on_nvme"] == 0 and 0 < mb["on_host"] < mb["params"], mb  # persistent buckets stay on the device
        assert mb["on_device"] == mb["optimizer"] + mb["grads"] + mb["params"] - mb["on_host"], mb


def check_offloaded_runs_equal_non_offloaded_bitwise(results: list[dict], directory: Path, stage: int,
                                                     host_page_reuse: bool = True) -> None:
    """Every variant at every world size: bitwise the same parameters, and each rank's bytes exactly.

    A rank's model states count its real elements only, so with padding (world 3) they differ from the
    formula's Ψ/N by a few elements, rank by rank; summed over the ranks they are the formula exactly.
    With ``host_page_reuse`` false (the GPU's path) nothing is ever parked."""
    world = len(results)
    for variant in results[0]:
        total = sum(r[variant]["mb"]["model_states"] for r in results)
        assert total == pytest.approx(world * results[0][variant]["mb"]["formula"], rel=1e-12, abs=0), variant
    assert sum(r["none/none"]["own"] for r in results) == results[0]["none/none"]["psi"]  # the shards cover Ψ
    for rank_result in results:
        for variant, r in rank_result.items():
            assert r["equal"], f"stage {stage} world {world} offload {variant}: parameters differ"
            if not host_page_reuse:
                assert r["parked"] == 0, variant
            mb, psi, own = r["mb"], r["psi"], r["own"]
            optimizer, param = variant.split("/")
            # fp32: 4-byte parameters and gradients (whole or this rank's share, by stage); Adam's two
            # moments (8 bytes), plus the fp32 masters (4) that offload keeps off the device
            assert mb["params"] == 4 * (own if stage == 3 else psi), variant
            assert mb["grads"] == 4 * (own if stage >= 2 else psi), variant
            assert mb["optimizer"] == (8 if optimizer == "none" else 12) * own, variant
            assert mb["model_states"] == mb["params"] + mb["grads"] + mb["optimizer"]
            moved = {"cpu": mb["on_host"], "nvme": mb["on_nvme"]}
            if variant == "none/none":
                assert mb["on_host"] == mb["on_nvme"] == 0 and mb["on_device"] == mb["model_states"]
            elif param == "none":
                assert moved[optimizer] == mb["optimizer"], variant  # all of it, nothing else
                assert mb["on_host"] + mb["on_nvme"] == mb["optimizer"], variant
                assert mb["on_device"] == mb["params"] + mb["grads"], variant
            else:
                # parameter shards leave the device too, except the persistent ones (kept whole there)
                kept = 4 * r["own_persistent"]
                assert 0 < kept < mb["params"]
                assert mb["on_device"] == mb["grads"] + kept, variant
                assert mb["on_host"] + mb["on_nvme"] == mb["optimizer"] + mb["params"] - kept, variant
                assert moved[optimizer] >= mb["optimizer"], variant
                if param == "cpu":
                    assert mb["on_nvme"] == 0, variant
        # (the swap files of a finished engine are removed; sizes are checked while it lives, below)


def _expected_sizes(engine) -> dict[str, int]:
    """Each swap file's size must be its tensor's bytes: fp32 pieces, and 4-byte fp32 shards here."""
    out = {}
    for pieces in engine.updater.pieces:
        for piece in pieces:
            for key in piece.files:
                out[f"optimizer/b{piece.bucket}_{piece.start}.{key}"] = piece.numel * 4
    store = getattr(engine.storage, "store", None)
    if store is not None and store.swap is not None:
        for index in store.swap.files:
            out[f"params/b{index}.shard"] = engine.storage.layout.buckets[index].shard_numel * 4
    return out


def swap_size_worker(rank: int, world: int, nvme: str) -> tuple[dict, dict, tuple[int, int]]:
    model = make_model()
    engine, _, _, _ = zeroshard.initialize(model=model, config=offload_config(3, nvme, "nvme", "nvme"))
    train(engine, rank, world, range(2))
    root = Path(nvme)
    sizes = {f"{d.name.split('_')[1]}/{f.name}": f.stat().st_size
             for d in root.iterdir() if f"rank{rank}_" in d.name for f in d.iterdir()}
    store = engine.storage.store
    held = store.device_shard.numel() + store.host_shard.numel()  # shard elements in memory
    expected = _expected_sizes(engine)
    engine.close()  # removes this rank's swap files at once
    assert not list(root.glob(f"*rank{rank}_*"))
    return sizes, expected, (held, engine.storage.layout.shard_numel())


def check_each_swap_file_is_exactly_its_tensor(results: list[tuple[dict, dict, tuple[int, int]]],
                                               directory: Path) -> None:
    for sizes, expected, (held, shard) in results:
        assert sizes == expected and len(sizes) > 10
        # parameters on NVMe: memory holds less than this rank's own shard (persistent vectors and the
        # first max_in_cpu = 600 elements); the rest is read for each all-gather
        assert held < shard / 2
        assert any(size % 4096 for size in sizes.values())  # odd sizes, no block padding
    assert not any(directory.iterdir()), "swap directories must be removed when the run ends"


def amsgrad_worker(rank: int, world: int, nvme: str, stage: int) -> dict:
    """AdamW with amsgrad under NVMe offload (parameters too at stage 3), the same without offload, and
    the reference: DDP + torch.optim.AdamW(amsgrad=True), and without amsgrad."""
    ref = make_model()
    plain = clone(ref)
    train_ddp(ref, rank, world, 4, 1, 2, amsgrad=True)
    train_ddp(plain, rank, world, 4, 1, 2)
    out: dict = {"amsgrad_matters": max_rel_diff(plain, ref)}
    for optimizer in ("nvme", "none"):
        param = "nvme" if optimizer == "nvme" and stage == 3 else "none"
        config = offload_config(stage, nvme, optimizer, param)
        config["optimizer"]["params"]["amsgrad"] = True
        model = make_model()
        engine, _, _, _ = zeroshard.initialize(model=model, config=config)
        train(engine, rank, world, range(4))
        with zeroshard.GatheredParameters(list(model.parameters())):
            out[optimizer] = {"diff": max_rel_diff(model, ref)}
        out[optimizer]["params"] = full_params(model)
        if optimizer == "nvme":  # the swap files while the engine lives: the running maximum is one of them
            out["files"] = {f.name: f.stat().st_size for d in Path(nvme).iterdir() if f"rank{rank}_" in d.name
                            for f in d.iterdir() if d.name.split("_")[1] == "optimizer"}
            out["expected"] = {k.split("/")[1]: v for k, v in _expected_sizes(engine).items()
                               if k.startswith("optimizer/")}
        engine.close()
    return out


def check_amsgrad_under_nvme_offload_matches_torch(results: list[dict], directory: Path, stage: int) -> None:
    """amsgrad: true is honoured under NVMe offload: its running maximum of the second moment is swapped
    like the moments, each file exactly its tensor, and training matches torch's AdamW(amsgrad=True)
    (to 1e-5, as the parity tests) and the same run without offload bitwise."""
    for r in results:
        assert r["amsgrad_matters"] > 1e-4  # 10x the tolerance: a run that ignored amsgrad would fail below
        assert r["nvme"]["diff"] <= 1e-5 and r["none"]["diff"] <= 1e-5, (r["nvme"]["diff"], r["none"]["diff"])
        assert all(torch.equal(r["nvme"]["params"][k], r["none"]["params"][k]) for k in r["none"]["params"])
        kinds = {name.split(".", 1)[1] for name in r["files"]}
        assert kinds == {"param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}, kinds
        assert r["files"] == r["expected"]


def resume_worker(rank: int, world: int, directory: str, stage: int, param: str, host_page_reuse: bool = True) -> dict:
    """Save under NVMe offload; resume into cpu offload and into no offload: all must continue identically."""
    nvme, checkpoints = Path(directory, "nvme"), str(Path(directory, "ckpt"))
    nvme.mkdir(exist_ok=True)
    first, _, _, _ = zeroshard.initialize(model=make_model(), config=offload_config(stage, str(nvme), "nvme", param,
                                                                                    host_page_reuse))
    train(first, rank, world, range(3))
    first.save_checkpoint(checkpoints)
    train(first, rank, world, range(3, 6))
    expected = full_params(first.module)
    first.close()
    out = {}
    for optimizer, into_param in (("nvme", param), ("cpu", "cpu" if param != "none" else "none"), ("none", "none")):
        engine, _, _, _ = zeroshard.initialize(model=make_model(seed=7), config=offload_config(
            stage, str(nvme), optimizer, into_param, host_page_reuse))
        engine.load_checkpoint(checkpoints)
        train(engine, rank, world, range(3, 6))
        params = full_params(engine.module)
        out[optimizer] = all(torch.equal(expected[k], params[k]) for k in expected)
        engine.close()
    return out


def check_offloaded_state_survives_a_checkpoint_into_any_offload_setting(results: list[dict], directory: Path,
                                                                         stage: int, param: str,
                                                                         host_page_reuse: bool = True) -> None:
    for result in results:
        assert result == {"nvme": True, "cpu": True, "none": True}


def io_error_worker(rank: int, world: int, nvme: str, damage: str) -> str:
    """Damage rank 1's swap files only: rank 1 must name the file, and rank 0 must stop with it."""
    engine, _, _, _ = zeroshard.initialize(model=make_model(), config=offload_config(2, nvme, "nvme"))
    swap_dir = next(Path(nvme).glob(f"*rank{rank}_*"))
    victim = swap_dir / "b0_0.exp_avg"
    if damage == "full" and rank == 1:
        # Before the first step: the file the first Adam moment will be written to is /dev/full, where
        # the kernel fails every write with ENOSPC, as on a full disk.
        victim.symlink_to("/dev/full")
    if damage == "removed":
        train(engine, rank, world, range(1))
        if rank == 1:
            victim.unlink()
    try:
        train(engine, rank, world, range(1, 2))
    except OffloadIOError as err:
        return f"{victim.name}|{err}"  # [Note: a case that may break its world runs last]
    engine.close()
    return "no error"


def check_swap_io_errors_are_clear_and_stop_every_rank(results: list[str], directory: Path, damage: str) -> None:
    expected = {"removed": "is missing: it was removed while training",
                "full": "No space left on device (the disk is full"}[damage]
    rank0, rank1 = results
    name, _, text = rank1.partition("|")
    assert name in text and expected in text, rank1
    assert "swap I/O failed on 1 other rank(s)" in rank0, rank0


@contextmanager
def preflight_problem(problem: str, rank: int) -> Iterator[None]:
    """A disk without room or a host without memory (``room_rank1``: on rank 1 only), undone afterwards
    (the next case in this process must see the machine as it is)."""
    import zeroshard.offload.preflight as preflight

    disk_usage, available = preflight.shutil.disk_usage, preflight.available_host_bytes
    if problem == "room" or (problem == "room_rank1" and rank == 1):
        preflight.shutil.disk_usage = lambda path: type("U", (), {"free": 1000})()  # type: ignore[assignment]
    if problem == "memory":
        preflight.available_host_bytes = lambda: 1000  # type: ignore[assignment]
    try:
        yield
    finally:
        preflight.shutil.disk_usage, preflight.available_host_bytes = disk_usage, available  # type: ignore[assignment]


def preflight_path(directory: str, problem: str) -> str:
    """The path a problem is checked on: missing, a file (which the test writes), /sys, or the case's own."""
    return str({"missing": Path(directory, "nope"), "file": Path(directory, "a_file"),
                "unwritable": Path("/sys")}.get(problem, Path(directory)))


def preflight_worker(rank: int, world: int, directory: str, problem: str) -> str:
    with preflight_problem(problem, rank):
        try:
            zeroshard.initialize(model=make_model(),
                                 config=offload_config(3, preflight_path(directory, problem), "nvme", "nvme"))
        except OffloadPreflightError as err:
            return str(err)
    return "no error"


PREFLIGHT_EXPECTED = {
    "missing": "zero_optimization.offload_optimizer.nvme_path '{p}/nope' does not exist",
    "file": "zero_optimization.offload_optimizer.nvme_path '{p}/a_file' is not a directory",
    "unwritable": "zero_optimization.offload_optimizer.nvme_path '/sys' is not writable (Permission denied)",
    "room": "has 0.00 GiB free but the swap files of 2 rank(s) need",
    "memory": "the offload buffers need",
}
#: /sys: a directory that not even root may create files in (where there is no sysfs, that case is left out)
PREFLIGHT_PROBLEMS = [p for p in PREFLIGHT_EXPECTED if p != "unwritable" or Path("/sys/kernel").is_dir()]


def check_preflight_names_the_path_and_the_numbers(results: list[str], directory: Path, problem: str) -> None:
    for message in results:
        assert PREFLIGHT_EXPECTED[problem].format(p=directory) in message, message


def check_preflight_failure_on_one_rank_stops_every_rank(results: list[str], directory: Path,
                                                         problem: str) -> None:
    rank0, rank1 = results
    assert "failed on 1 other rank(s)" in rank0 and "GiB free" in rank1


def estimate_worker(rank: int, world: int, nvme: str) -> dict:
    config = {**offload_config(3, nvme, "cpu", "cpu"), "bf16": {"enabled": True},
              "data_types": {"grad_accum_dtype": "bf16"}}
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every parameter offloaded
    engine, _, _, _ = zeroshard.initialize(model=make_model(), config=config)
    train(engine, rank, world, range(1))
    out = {"mb": engine.memory_breakdown(), "psi": engine.strategy.layout.numel}
    engine.close()
    return out


def check_breakdown_by_place_agrees_with_estimate(results: list[dict], directory: Path) -> None:
    psi = results[0]["psi"]
    estimate = estimate_stage(EstimateRequest(psi, 2, "mixed", offload="params"), 3)
    host = sum(r["mb"]["on_host"] for r in results) / 2
    device = sum(r["mb"]["on_device"] for r in results) / 2
    # host: fp32 masters + Adam (12Ψ/N) + 16-bit parameter shards (2Ψ/N); device: 16-bit gradients (2Ψ/N)
    assert host == pytest.approx(estimate.host) and device == pytest.approx(estimate.model_states)


def modify_worker(rank: int, world: int, nvme: str, optimizer: str) -> tuple[int, bool]:
    """GatheredParameters(modifier_rank=0) edits one weight of a bf16 run: exactly its masters change."""
    config = {**offload_config(2, nvme, optimizer), "bf16": {"enabled": True}}
    engine, _, _, _ = zeroshard.initialize(model=make_model(), config=config)
    train(engine, rank, world, range(2))

    def masters() -> torch.Tensor:
        return torch.cat([engine.updater.read_bucket(b)[0] for b in engine.strategy.layout.buckets])

    before = masters()
    weight = engine.module.ln_f.weight
    with zeroshard.GatheredParameters([weight], modifier_rank=0):
        if rank == 0:
            weight.data.fill_(0.5)
    after = masters()
    changed = before != after
    engine.close()
    return int(changed.sum()), bool((after[changed] == 0.5).all())


def check_modified_parameters_reach_the_masters_and_only_they(results: list[tuple[int, bool]], directory: Path,
                                                              optimizer: str) -> None:
    # ln_f.weight has 16 elements, split between the ranks' shards; every other master keeps its fp32 value
    assert sum(count for count, _ in results) == 16 and all(ok for _, ok in results)


#: each case's worker (called with the case's own directory first), and the check of its results (one per rank)
WORKERS: dict[str, Callable[..., Any]] = {
    "offloaded_runs_equal_non_offloaded_bitwise": parity_worker,
    "each_swap_file_is_exactly_its_tensor": swap_size_worker,
    "amsgrad_under_nvme_offload_matches_torch": amsgrad_worker,
    "offloaded_state_survives_a_checkpoint_into_any_offload_setting": resume_worker,
    "swap_io_errors_are_clear_and_stop_every_rank": io_error_worker,
    "preflight_names_the_path_and_the_numbers": preflight_worker,
    "preflight_failure_on_one_rank_stops_every_rank": preflight_worker,
    "breakdown_by_place_agrees_with_estimate": estimate_worker,
    "modified_parameters_reach_the_masters_and_only_they": modify_worker,
    "parameters_alone_offloaded_compute_and_train_as_one_process": params_alone_worker,
}
CHECKS: dict[str, Callable[..., None]] = {
    "offloaded_runs_equal_non_offloaded_bitwise": check_offloaded_runs_equal_non_offloaded_bitwise,
    "each_swap_file_is_exactly_its_tensor": check_each_swap_file_is_exactly_its_tensor,
    "amsgrad_under_nvme_offload_matches_torch": check_amsgrad_under_nvme_offload_matches_torch,
    "offloaded_state_survives_a_checkpoint_into_any_offload_setting":
        check_offloaded_state_survives_a_checkpoint_into_any_offload_setting,
    "swap_io_errors_are_clear_and_stop_every_rank": check_swap_io_errors_are_clear_and_stop_every_rank,
    "preflight_names_the_path_and_the_numbers": check_preflight_names_the_path_and_the_numbers,
    "preflight_failure_on_one_rank_stops_every_rank": check_preflight_failure_on_one_rank_stops_every_rank,
    "breakdown_by_place_agrees_with_estimate": check_breakdown_by_place_agrees_with_estimate,
    "modified_parameters_reach_the_masters_and_only_they": check_modified_parameters_reach_the_masters_and_only_they,
    "parameters_alone_offloaded_compute_and_train_as_one_process":
        check_parameters_alone_offloaded_compute_and_train_as_one_process,
}
#: stage and precision of the checks whose arguments do not say them
SETTINGS: dict[str, dict[str, Any]] = {
    "each_swap_file_is_exactly_its_tensor": {"stage": 3},
    "swap_io_errors_are_clear_and_stop_every_rank": {"stage": 2},
    "preflight_names_the_path_and_the_numbers": {"stage": 3},
    "preflight_failure_on_one_rank_stops_every_rank": {"stage": 3},
    "breakdown_by_place_agrees_with_estimate": {"stage": 3, "precision": "bf16"},
    "modified_parameters_reach_the_masters_and_only_they": {"stage": 2, "precision": "bf16"},
}

PARITY: list[Case] = [("offloaded_runs_equal_non_offloaded_bitwise", {"stage": stage}) for stage in (1, 2, 3)]
#: ``host_page_reuse: False``: the GPU's path on the CPU (see [Note: one buffer memory per engine] in
#: host/buffer_memory.py), beside the host's in the same world
DEVICE_PATH = {"host_page_reuse": False}
# [Note: a case that may break its world runs last]
# A case that ends in an error on purpose (a swap file damaged under a live engine) leaves that engine
# as the error found it, with whatever it had in flight: such cases run after every other of their world.
DEFAULT_CASES: dict[int, list[Case]] = {
    1: PARITY,
    2: PARITY + [("offloaded_runs_equal_non_offloaded_bitwise", {"stage": 3, **DEVICE_PATH}),
                 ("breakdown_by_place_agrees_with_estimate", {}),
                 ("parameters_alone_offloaded_compute_and_train_as_one_process", {"stage": 3}),
                 ("preflight_failure_on_one_rank_stops_every_rank", {"problem": "room_rank1"}),
                 ("swap_io_errors_are_clear_and_stop_every_rank", {"damage": "removed"}),
                 ("swap_io_errors_are_clear_and_stop_every_rank", {"damage": "full"})],
    3: PARITY,
}
EXTENDED_CASES: dict[int, list[Case]] = {
    2: [("each_swap_file_is_exactly_its_tensor", {}),
        ("amsgrad_under_nvme_offload_matches_torch", {"stage": 2}),
        ("amsgrad_under_nvme_offload_matches_torch", {"stage": 3}),
        ("offloaded_state_survives_a_checkpoint_into_any_offload_setting", {"stage": 2, "param": "none"}),
        ("offloaded_state_survives_a_checkpoint_into_any_offload_setting", {"stage": 3, "param": "nvme"}),
        ("offloaded_state_survives_a_checkpoint_into_any_offload_setting",
         {"stage": 3, "param": "nvme", **DEVICE_PATH}),
        *[("modified_parameters_reach_the_masters_and_only_they", {"optimizer": o}) for o in ("none", "cpu", "nvme")],
        *[("preflight_names_the_path_and_the_numbers", {"problem": p}) for p in PREFLIGHT_PROBLEMS]],
    3: [("each_swap_file_is_exactly_its_tensor", {})],  # world 3: padded buckets, chunks of unequal real size
}


def labels(name: str, world: int, arguments: dict[str, Any]) -> dict[str, Any]:
    """How a case is named in failures: its check, stage, world size, precision and other arguments."""
    rest = {"precision": "fp32", **SETTINGS.get(name, {}), **arguments}
    return {"check": name, "stage": rest.pop("stage"), "world": world, "precision": rest.pop("precision"), **rest}


def prepare_directories(root: Path, cases: list[Case]) -> None:
    """A directory per case (its swap files, checkpoints and pre-flight paths), a file in each pre-flight's."""
    for index, (name, _) in enumerate(cases):
        case_directory(root, index).mkdir()
        if name.startswith("preflight"):
            (case_directory(root, index) / "a_file").write_text("x")


def check_cases(world: int, cases: list[Case], root: Path) -> None:
    prepare_directories(root, cases)
    by_rank = run_family(world, cases, WORKERS, labels=labels, root=root)
    check_family(cases, by_rank, CHECKS, world, labels=labels, root=root)


@pytest.mark.parametrize("world", sorted(DEFAULT_CASES))
def test_offload_cases(world: int, tmp_path: Path) -> None:
    """Every world size: offloaded runs equal non-offloaded ones bitwise at stages 1-3 (and each rank's
    bytes exactly).  World 2 also: the breakdown by place agrees with the estimate, a pre-flight failure on
    one rank stops every rank, swap I/O errors (a file removed, a full disk) are clear and stop every rank."""
    check_cases(world, DEFAULT_CASES[world], tmp_path)


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
@pytest.mark.parametrize("world", sorted(EXTENDED_CASES))
def test_offload_extended_cases(world: int, tmp_path: Path) -> None:
    """Each swap file is exactly its tensor (worlds 2 and 3).  World 2 also: amsgrad under NVMe offload
    matches torch's (stages 2, 3), offloaded state survives a checkpoint into any offload setting, modified
    parameters reach the masters and only they (no, cpu and nvme offload), the pre-flight checks name the
    path and the numbers."""
    check_cases(world, EXTENDED_CASES[world], tmp_path)
