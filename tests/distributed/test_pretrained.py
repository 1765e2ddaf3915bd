"""Pretrained weights straight into the shards (``zeroshard.load_pretrained``): a Hugging Face model saved
locally (small configs, random init, nothing downloaded) loads into a model built under
``zeroshard.Init`` and into live engines at stages 1 and 3, bitwise equal to a plain
``from_pretrained``, each rank reading only the byte ranges it keeps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zeroshard
import zeroshard.checkpoint.pretrained
from zeroshard.tools.testing import run_world

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


def counting_reads() -> list[int]:
    """Count the bytes this process reads through zeroshard.checkpoint.pretrained's positioned reads."""
    read: list[int] = [0]
    original = zeroshard.checkpoint.pretrained.os.preadv

    def preadv(fd: int, buffers: list, offset: int) -> int:
        n = original(fd, buffers, offset)
        read[0] += n
        return n
    zeroshard.checkpoint.pretrained.os.preadv = preadv  # type: ignore[assignment]
    return read


def under_init(rank: int, world: int, directory: str, stage: int) -> dict:
    read = counting_reads()
    cfg = transformers.AutoConfig.from_pretrained(directory)
    with zeroshard.Init(config=config(stage)):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    zeroshard.load_pretrained(model, directory)
    bytes_read = read[0]
    engine, _, _, _ = zeroshard.initialize(model=model, config=config(stage))
    state = engine.full_state_dict(rank0_only=False)
    engine.close()
    return {"state": state, "read": bytes_read}


def into_engine(rank: int, world: int, directory: str, stage: int, precision: str) -> dict:
    torch.manual_seed(rank + 5)  # a different random model on every rank: the load makes them equal
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))
    engine, _, _, _ = zeroshard.initialize(model=model, config=config(stage, precision))
    read = counting_reads()
    zeroshard.load_pretrained(engine, directory)
    out = {"state": engine.full_state_dict(rank0_only=False), "read": read[0]}
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    out["loss"] = float(engine(input_ids=ids, labels=ids).loss)
    engine.close()
    return out


def file_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


@pytest.mark.parametrize("kind,sharded,world", [("llama", False, 2),
                                               pytest.param("gpt2", True, 3, marks=pytest.mark.slow)])
def test_a_model_built_under_init_loads_its_slices_only(kind: str, sharded: bool, world: int,
                                                         tmp_path: Path) -> None:
    expected = save(kind, tmp_path, sharded)
    assert (tmp_path / "model.safetensors.index.json").is_file() == sharded
    results = run_world(under_init, world, args=(str(tmp_path), 3))
    for result in results:
        for name, value in expected.items():
            assert torch.equal(result["state"][name], value), name
    total = file_bytes(tmp_path)
    # each rank read about its 1/N (Init shards every parameter), never the model
    assert all(r["read"] <= total / world * 1.05 + 4096 for r in results), ([r["read"] for r in results], total)
    assert sum(r["read"] for r in results) >= 0.95 * (total - 4096 * len(list(tmp_path.glob("*.safetensors"))))


@pytest.mark.parametrize("stage,precision", [(3, "fp32"), pytest.param(1, "fp32", marks=pytest.mark.slow),
                                             pytest.param(3, "bf16", marks=pytest.mark.slow)])
def test_a_live_engine_loads_pretrained_weights_reading_only_its_chunks(stage: int, precision: str,
                                                                         tmp_path: Path) -> None:
    expected = save("llama", tmp_path, sharded=False)
    results = run_world(into_engine, 2, args=(str(tmp_path), stage, precision))
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    for result in results:
        for name, value in expected.items():
            want = value if precision == "fp32" or not value.is_floating_point() else value.to(torch.bfloat16)
            assert torch.equal(result["state"][name], want), name
        if precision == "fp32":
            assert result["loss"] == pytest.approx(float(plain(input_ids=ids, labels=ids).loss), rel=1e-6)
        # stage 3: the chunks plus the small persistent parameters; stage 1: the owned chunk
        assert result["read"] <= file_bytes(tmp_path) * 0.6, result["read"]


def missing(rank: int, world: int, directory: str) -> str:
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))
    model.extra = torch.nn.Linear(2, 2)
    engine, _, _, _ = zeroshard.initialize(model=model, config=config(3))
    before = engine.full_state_dict(rank0_only=False)
    try:
        zeroshard.load_pretrained(engine, directory)
    except zeroshard.PretrainedError as err:
        after = engine.full_state_dict(rank0_only=False)
        assert all(torch.equal(after[k], v) for k, v in before.items())  # nothing changed
        return str(err)
    return "loaded"


def test_a_parameter_missing_from_the_checkpoint_is_named_before_anything_changes(tmp_path: Path) -> None:
    save("llama", tmp_path, sharded=False)
    for message in run_world(missing, 2, args=(str(tmp_path),)):
        assert "the checkpoint has no tensor for extra." in message  # the first of extra.weight / .bias checked
    with pytest.raises(zeroshard.PretrainedError, match="no model.safetensors"):
        zeroshard.load_pretrained(torch.nn.Linear(2, 2), tmp_path / "nowhere")


def hf_from_pretrained_under_init(rank: int, world: int, directory: str) -> dict:
    with zeroshard.Init(config=config(3)):
        model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    sharded = all(type(p).__name__ == "InitShardedParameter" for p in model.parameters())
    engine, _, _, _ = zeroshard.initialize(model=model, config=config(3))
    state = engine.full_state_dict(rank0_only=False)
    engine.close()
    return {"state": state, "sharded": sharded}


@pytest.mark.parametrize("kind,sharded", [pytest.param("llama", False, marks=pytest.mark.slow), ("gpt2", True)])
def test_from_pretrained_under_init_builds_the_sharded_model(kind: str, sharded: bool, tmp_path: Path) -> None:
    """transformers builds on the meta device and assigns each loaded parameter: Init shards each as it
    comes (every rank reads every tensor here; load_pretrained reads only a rank's slices)."""
    expected = save(kind, tmp_path, sharded)
    for result in run_world(hf_from_pretrained_under_init, 2, args=(str(tmp_path),)):
        assert result["sharded"]
        for name, value in expected.items():
            assert torch.equal(result["state"][name], value), name


def released_under_init(rank: int, world: int, directory: str) -> dict:
    init = zeroshard.Init(config=config(3))
    with init:
        model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    engine, _, _, _ = zeroshard.initialize(model=model, config=config(3))
    state = engine.full_state_dict(rank0_only=False)
    engine.close()
    return {"state": state, "released": init.released_file_bytes}


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


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="Linux only")
def test_from_pretrained_under_init_gives_back_the_mapped_file_pages(tmp_path: Path) -> None:
    """[Note: mapped checkpoint pages under Init]: each weight's pages go back once its slice is kept,
    so a rank's RSS grows by its shards, not the model (benchmarks/bench_pretrained.py measures it)."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32)).save_pretrained(str(tmp_path))
    expected = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).state_dict()
    released = interior_page_bytes(tmp_path / "model.safetensors")
    assert released >= 4 * (1 << 20) - 4 * 4096  # embedding, head and the two 1 MiB MLP matrices
    for result in run_world(released_under_init, 2, args=(str(tmp_path),)):
        assert result["released"] == released
        for name, value in expected.items():
            assert torch.equal(result["state"][name], value), name
