"""Single-process reliability checks: ckpt-info reports non-finite values; non-finite steps are skipped."""

import math

import torch
from torch import nn

import zeroshard
from zeroshard.checkpoint import describe


def engine_for(model: nn.Module, **extra):
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 1}, **extra}
    engine, *_ = zeroshard.initialize(model=model, config=config)
    return engine


def test_ckpt_info_reports_non_finite_tensors(tmp_path) -> None:
    engine = engine_for(nn.Linear(3, 2))
    engine.save_checkpoint(tmp_path, tag="ok")
    assert "values       all finite" in describe(tmp_path, "ok")
    with torch.no_grad():
        engine.module.bias.fill_(float("nan"))
    engine.save_checkpoint(tmp_path, tag="bad")
    report = describe(tmp_path, "bad")
    assert "NOT FINITE: bias" in report and "weight" not in report.split("NOT FINITE:")[1]


def test_a_nan_loss_in_one_process_skips_the_step_and_keeps_the_parameters() -> None:
    engine = engine_for(nn.Linear(3, 2))
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    loss = engine(torch.ones(1, 3)).sum() * float("nan")
    engine.backward(loss)
    engine.step()
    assert engine.skipped_steps == 1 and engine.optimizer.overflow and not engine.was_step_applied()
    for k, v in engine.module.state_dict().items():
        assert torch.equal(v, before[k]), k
    engine.backward(engine(torch.ones(1, 3)).sum())
    engine.step()
    assert engine.was_step_applied() and all(math.isfinite(float(p.sum())) for p in engine.module.parameters())


def test_pruning_keeps_the_newest_periodic_checkpoints_and_never_what_latest_names(tmp_path) -> None:
    from zeroshard.checkpoint.rotation import prune

    for name in ("global_step2", "global_step4", "global_step10", "global_step12", "best", "global_step14"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("{}")
    (tmp_path / ".global_step1.deleting").mkdir()  # a prune killed midway
    (tmp_path / ".global_step16.incomplete").mkdir()  # a save in progress or killed: not a checkpoint
    (tmp_path / "global_step14" / "manifest.json").unlink()  # incomplete: not counted, not removed
    (tmp_path / "latest").write_text("global_step2")  # e.g. a script that resumed from an old one
    removed = prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in removed) == ["global_step4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".global_step16.incomplete", "best", "global_step10", "global_step12", "global_step14", "global_step2",
        "latest"]


def test_loads_and_closed_engines_hold_no_files(tmp_path) -> None:
    """A soak run found every load left the checkpoint's files open (pruned checkpoints kept their
    disk space until the process ended): loads, failed loads, ckpt-info and close() hold nothing."""
    import os

    def held() -> list[str]:
        links = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
        return [link for link in links if str(tmp_path) in link]

    engine = engine_for(nn.Linear(3, 2))
    engine.save_checkpoint(tmp_path, tag="a")
    engine.load_checkpoint(tmp_path, tag="a")
    describe(tmp_path, "a")
    assert held() == []
    (tmp_path / "a" / "rank00000.safetensors").write_bytes(b"broken")
    try:
        engine.load_checkpoint(tmp_path, tag="a")
    except zeroshard.checkpoint.CheckpointError:
        pass
    assert held() == []
    engine.close()
    count = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        engine_for(nn.Linear(3, 2)).close()
    assert len(os.listdir("/proc/self/fd")) == count


def test_client_state_with_tensors_round_trips_exactly_and_nothing_is_pickled(tmp_path) -> None:
    """Client state as trainers hand it (Lightning's callbacks keep tensors; tuples, keys that are not
    strings) loads back as the same object: tensors with their dtype, shape and values in a safetensors
    file, the rest JSON; an object that only a pickle could hold is refused by its place."""
    from zeroshard.checkpoint.format import CheckpointError

    engine = engine_for(nn.Linear(3, 2))
    wide = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"epoch": 2, "best": torch.tensor(0.25), "kth": torch.tensor(float("inf")),
             "scores": {"a.ckpt": torch.tensor([1.5, 2.5], dtype=torch.bfloat16)}, "steps": (1, [2, 3], "x"),
             "by_index": {0: "first", 1: torch.tensor([7], dtype=torch.int64)}, "odd": {"__tensor__": "literal"},
             "view": wide.t(), "grad": torch.ones(2, requires_grad=True), "none": None, "rate": float("inf")}
    engine.save_checkpoint(tmp_path, tag="t", client_state=state)
    _, loaded = engine.load_checkpoint(tmp_path, tag="t")

    def same(a, b) -> bool:
        if isinstance(a, torch.Tensor):
            return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                    and torch.equal(a.detach(), b))
        if isinstance(a, dict):
            return type(b) is dict and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b and type(a) is type(b)

    assert same(state, loaded)
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == [
        "client_state.safetensors", "manifest.json", "rank00000.safetensors"]
    for refused, place in [({"cb": {"obj": object()}}, "client_state['cb']['obj']"), ({"s": {1, 2}}, "client_state['s']"),
                           ({"k": {(1, 2): 3}}, "client_state['k']")]:
        try:
            engine.save_checkpoint(tmp_path, tag="r", client_state=refused)
        except CheckpointError as error:
            assert str(error).startswith(f"{place} cannot be saved"), error
        else:
            raise AssertionError(f"{refused} was saved")
