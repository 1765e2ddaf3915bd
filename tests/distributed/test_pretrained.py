"""Pretrained weights straight into the shards (``zeroshard.load_pretrained``): a Hugging Face model saved
locally (small configs, random init, nothing downloaded) loads into a model built under
``zeroshard.Init`` and into live engines at stages 1 and 3, bitwise equal to a plain
``from_pretrained``, each rank reading only the byte ranges it keeps.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

import zeroshard
import zeroshard.checkpoint.pretrained
from zeroshard.tools.testing import run_named_cases, run_world

transformers = pytest.importorskip("transformers")

VOCAB = 101


def build(kind: str) -> torch.nn.Module:
    if kind == "gpt2":  # tied embedding and head: saved once
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32))


def save(kind: str, directory: Path, sharded: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = build(kind)
    model.save_pretrained(str(directory), max_shard_size="20KB" if sharded else "5GB")
    return transformers.AutoModelForCausalLM.from_pretrained(str(directory)).state_dict()


def config(stage: int, precision: str = "fp32") -> dict:
    out = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 64}}
    if precision == "bf16":
        out["bf16"] = {"enabled": True}
    return out


@contextmanager
def counting_reads() -> Iterator[list[int]]:
    """Count the bytes this process reads through zeroshard.checkpoint.pretrained's positioned reads."""
    read: list[int] = [0]
    original = zeroshard.checkpoint.pretrained.os.preadv

    def preadv(fd: int, buffers: list, offset: int) -> int:
        n = original(fd, buffers, offset)
        read[0] += n
        return n
    zeroshard.checkpoint.pretrained.os.preadv = preadv  # type: ignore[assignment]
    try:
        yield read
    finally:
        zeroshard.checkpoint.pretrained.os.preadv = original  # type: ignore[assignment]


def under_init(rank: int, world: int, directory: str, stage: int) -> dict:
    cfg = transformers.AutoConfig.from_pretrained(directory)
    with zeroshard.Init(config=config(stage)):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    with counting_reads() as read:
        zeroshard.load_pretrained(model, directory)
    engine, _, _, _ = zeroshard.initialize(model=model, config=config(stage))
    state = engine.full_state_dict(rank0_only=False)
    engine.close()
    return {"state": state, "read": read[0]}


def into_engine(rank: int, world: int, directory: str, stage: int, precision: str) -> dict:
    torch.manual_seed(rank + 5)  # a different random model on every rank: the load makes them equal
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))
    engine, _, _, _ = zeroshard.initialize(model=model, config=config(stage, precision))
    with counting_reads() as read:
        zeroshard.load_pretrained(engine, directory)
    out = {"state": engine.full_state_dict(rank0_only=False), "read": read[0]}
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    out["loss"] = float(engine(input_ids=ids, labels=ids).loss)
    engine.close()
    return out


def missing(rank: int, world: int, directory: str) -> str:
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))
    model.extra = torch.nn.Linear(2, 2)
    engine, _, _, _ = zeroshard.initialize(model=model, config=config(3))
    before = engine.full_state_dict(rank0_only=False)
    try:
        zeroshard.load_pretrained(engine, directory)
        message = "loaded"
    except zeroshard.PretrainedError as err:
        after = engine.full_state_dict(rank0_only=False)
        assert all(torch.equal(after[k], v) for k, v in before.items())  # nothing changed
        message = str(err)
    engine.close()
    return message


def hf_from_pretrained_under_init(rank: int, world: int, directory: str) -> dict:
    with zeroshard.Init(config=config(3)):
        model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    sharded = all(type(p).__name__ == "InitShardedParameter" for p in model.parameters())
    engine, _, _, _ = zeroshard.initialize(model=model, config=config(3))
    state = engine.full_state_dict(rank0_only=False)
    engine.close()
    return {"state": state, "sharded": sharded}


def released_under_init(rank: int, world: int, directory: str) -> dict:
    init = zeroshard.Init(config=config(3))
    with init:
        model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    engine, _, _, _ = zeroshard.initialize(model=model, config=config(3))
    state = engine.full_state_dict(rank0_only=False)
    engine.close()
    return {"state": state, "released": init.released_file_bytes}


HAS_PAGEMAP = Path("/proc/self/pagemap").exists()


@dataclass(frozen=True)
class Case:
    """One load, run in the world of the fixture ``world`` (with the other cases of that fixture)."""
    world: str
    run: Callable[..., Any]
    checkpoint: str  # a key of the ``checkpoints`` fixture
    args: tuple = ()


#: the worlds that run the cases: the default cases in one, the extended ones in one per world size
WORLD_SIZES = {"world2": 2, "world2_extended": 2, "world3_extended": 3}
CASES = {
    "under_init llama": Case("world2", under_init, "llama", (3,)),
    "under_init gpt2 sharded": Case("world3_extended", under_init, "gpt2_sharded", (3,)),
    "into_engine stage 3 fp32": Case("world2", into_engine, "llama", (3, "fp32")),
    "into_engine stage 1 fp32": Case("world2_extended", into_engine, "llama", (1, "fp32")),
    "into_engine stage 3 bf16": Case("world2_extended", into_engine, "llama", (3, "bf16")),
    "missing": Case("world2", missing, "llama"),
    "from_pretrained gpt2 sharded": Case("world2", hf_from_pretrained_under_init, "gpt2_sharded"),
    "from_pretrained llama": Case("world2_extended", hf_from_pretrained_under_init, "llama"),
    **({"released": Case("world2", released_under_init, "wide_llama")} if HAS_PAGEMAP else {}),
}



def save_wide_llama(directory: Path) -> dict[str, torch.Tensor]:
    """A model whose weights span many pages (the embedding, head and two MLP matrices of 1 MiB each)."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32)).save_pretrained(str(directory))
    return transformers.AutoModelForCausalLM.from_pretrained(str(directory)).state_dict()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """The checkpoints the cases load, saved once: name -> (directory, what a plain from_pretrained gives)."""
    out = {}
    for name, kind, sharded in (("llama", "llama", False), ("gpt2_sharded", "gpt2", True)):
        directory = tmp_path_factory.mktemp(name)
        out[name] = (directory, save(kind, directory, sharded))
    if HAS_PAGEMAP:
        directory = tmp_path_factory.mktemp("wide_llama")
        out["wide_llama"] = (directory, save_wide_llama(directory))
    return out


def run_cases(world: str, checkpoints: dict[str, tuple[Path, dict]]) -> dict[str, list[Any]]:
    """Every case of the fixture ``world`` in one world: each case's results, by rank."""
    cases = {name: (c.run, (str(checkpoints[c.checkpoint][0]), *c.args)) for name, c in CASES.items()
             if c.world == world}
    by_rank = run_world(run_named_cases, WORLD_SIZES[world], args=(cases,), timeout=600)
    return {name: [r[name] for r in by_rank] for name in cases}


@pytest.fixture(scope="module")
def world2(checkpoints) -> dict[str, list[Any]]:
    return run_cases("world2", checkpoints)


@pytest.fixture(scope="module")
def world2_extended(checkpoints) -> dict[str, list[Any]]:
    return run_cases("world2_extended", checkpoints)


@pytest.fixture(scope="module")
def world3_extended(checkpoints) -> dict[str, list[Any]]:
    return run_cases("world3_extended", checkpoints)


def results_of(request: pytest.FixtureRequest, name: str) -> list[Any]:
    """A case's results by rank, from the world that runs it (started at the first test that needs it)."""
    return request.getfixturevalue(CASES[name].world)[name]


def file_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


@pytest.mark.parametrize("kind,sharded,world", [("llama", False, 2),
                                               pytest.param("gpt2", True, 3, marks=pytest.mark.slow)])
def test_a_model_built_under_init_loads_its_slices_only(kind: str, sharded: bool, world: int, checkpoints,
                                                         request: pytest.FixtureRequest) -> None:
    case_name = f"under_init {kind}{' sharded' if sharded else ''}"
    directory, expected = checkpoints[CASES[case_name].checkpoint]
    assert (directory / "model.safetensors.index.json").is_file() == sharded
    results = results_of(request, case_name)
    assert len(results) == world
    for result in results:
        for name, value in expected.items():
            assert torch.equal(result["state"][name], value), name
    total = file_bytes(directory)
    # each rank read about its 1/N (Init shards every parameter), never the model
    assert all(r["read"] <= total / world * 1.05 + 4096 for r in results), ([r["read"] for r in results], total)
    assert sum(r["read"] for r in results) >= 0.95 * (total - 4096 * len(list(directory.glob("*.safetensors"))))


@pytest.mark.parametrize("stage,precision", [(3, "fp32"), pytest.param(1, "fp32", marks=pytest.mark.slow),
                                             pytest.param(3, "bf16", marks=pytest.mark.slow)])
def test_a_live_engine_loads_pretrained_weights_reading_only_its_chunks(stage: int, precision: str, checkpoints,
                                                                         request: pytest.FixtureRequest) -> None:
    case_name = f"into_engine stage {stage} {precision}"
    directory, expected = checkpoints[CASES[case_name].checkpoint]
    results = results_of(request, case_name)
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(directory))
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    for result in results:
        for name, value in expected.items():
            want = value if precision == "fp32" or not value.is_floating_point() else value.to(torch.bfloat16)
            assert torch.equal(result["state"][name], want), name
        if precision == "fp32":
            assert result["loss"] == pytest.approx(float(plain(input_ids=ids, labels=ids).loss), rel=1e-6)
        # stage 3: the chunks plus the small persistent parameters; stage 1: the owned chunk
        assert result["read"] <= file_bytes(directory) * 0.6, result["read"]


def test_a_parameter_missing_from_the_checkpoint_is_named_before_anything_changes(world2, tmp_path: Path) -> None:
    for message in world2["missing"]:
        assert "the checkpoint has no tensor for extra." in message  # the first of extra.weight / .bias checked
    with pytest.raises(zeroshard.PretrainedError, match="no model.safetensors"):
        zeroshard.load_pretrained(torch.nn.Linear(2, 2), tmp_path / "nowhere")


@pytest.mark.parametrize("kind,sharded", [pytest.param("llama", False, marks=pytest.mark.slow), ("gpt2", True)])
def test_from_pretrained_under_init_builds_the_sharded_model(kind: str, sharded: bool, checkpoints,
                                                             request: pytest.FixtureRequest) -> None:
    """transformers builds on the meta device and assigns each loaded parameter: Init shards each as it
    comes (every rank reads every tensor here; load_pretrained reads only a rank's slices)."""
    case_name = f"from_pretrained {kind}{' sharded' if sharded else ''}"
    _, expected = checkpoints[CASES[case_name].checkpoint]
    for result in results_of(request, case_name):
        assert result["sharded"]
        for name, value in expected.items():
            assert torch.equal(result["state"][name], value), name


def interior_page_bytes(file: Path) -> int:
    """What every rank should give back: the whole pages inside each weight of at least MIN_BYTES."""
    import json
    import mmap
    import struct

    from zeroshard.host.file_pages import MIN_BYTES
    raw = file.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_len])
    page, total = mmap.PAGESIZE, 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = (8 + header_len + offset for offset in entry["data_offsets"])
        if end - begin >= MIN_BYTES:
            total += max(0, end // page * page - -(-begin // page) * page)
    return total


@pytest.mark.skipif(not HAS_PAGEMAP, reason="Linux only")
def test_from_pretrained_under_init_gives_back_the_mapped_file_pages(checkpoints, world2) -> None:
    """[Note: mapped checkpoint pages under Init]: each weight's pages go back once its slice is kept,
    so a rank's RSS grows by its shards, not the model (benchmarks/bench_pretrained.py measures it)."""
    directory, expected = checkpoints["wide_llama"]
    released = interior_page_bytes(directory / "model.safetensors")
    assert released >= 4 * (1 << 20) - 4 * 4096  # embedding, head and the two 1 MiB MLP matrices
    for result in world2["released"]:
        assert result["released"] == released
        for name, value in expected.items():
            assert torch.equal(result["state"][name], value), name
