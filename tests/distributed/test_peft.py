"""peft's LoRA, as people use it: ``get_peft_model(model, LoraConfig(...))`` on a Hugging Face Llama or
GPT-2 (small configs, random init, nothing downloaded), trained at stages 0-3 equal to one plain
PyTorch process on the same global batches; at stage 3 the frozen base is sharded; the adapter that
comes out (from the live engine, and from a checkpoint with ``zeroshard consolidate --trainable-only``)
is one that ``PeftModel.from_pretrained`` loads.  One world per world size runs its cases in turn, each
with an engine of its own, closed before the next; a failure names kind, stage, world, precision and
whether the base came from a saved model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

import zeroshard
from zeroshard.tools.testing import CaseFailures, case, run_world

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB, STEPS, MICRO, SEQ = 101, 3, 2, 12
TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}


def base(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32))


def lora(kind: str, model: Optional[torch.nn.Module] = None) -> Any:
    model = base(kind) if model is None else model
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS[kind],
                             init_lora_weights="gaussian")  # B not zero: every LoRA weight has a gradient
    return peft.get_peft_model(model, config)


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(100 * step + rank))


def reference(kind: str, world: int) -> dict[str, torch.Tensor]:
    """One process, plain PyTorch: each step the whole global batch (every rank's rows)."""
    model = lora(kind)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    for step in range(STEPS):
        ids = torch.cat([batch(step, r) for r in range(world)])
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def peft_case(rank: int, world: int, directory: str, kind: str, stage: int, precision: str,
              pretrained: bool) -> dict:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 64}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if pretrained:  # the base read from a saved model, each parameter sharded as transformers assigns it
        with zeroshard.Init(config=config):
            model = lora(kind, transformers.AutoModelForCausalLM.from_pretrained(str(Path(directory) / "base")))
        assert all(type(p).__name__ == "InitShardedParameter" for n, p in model.named_parameters()
                   if "lora_" not in n)
    else:
        model = lora(kind)
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    for step in range(STEPS):
        ids = batch(step, rank)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    frozen = [b for b in engine.storage.layout.buckets if b.frozen]
    out: dict[str, Any] = {"storage": held_storage(engine) if stage == 3 else None,
                           "state": engine.full_state_dict(rank0_only=False),
                           "frozen_shard_numel": sum(b.real_numel_in_shard(engine.world.rank) for b in frozen),
                           "frozen_numel": sum(b.numel for b in frozen),
                           "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    # the adapter from the live engine, as a peft user saves it (every rank gathers; rank 0 writes)
    state = engine.full_state_dict()
    if rank == 0:
        model.save_pretrained(str(Path(directory) / "live_adapter"), state_dict=state)
    engine.save_checkpoint(str(Path(directory) / "ckpt"), tag="lora")
    engine.close()
    return out


def held_storage(engine: Any) -> dict[str, int]:
    """Bytes this rank's storages hold for the frozen base between steps, measured on the tensors."""
    flat = engine.storage
    frozen = [b for b in flat.layout.buckets if b.frozen]
    chunks = [flat.store.view(b) for b in frozen]
    frozen_names = {s.name for b in frozen for s in b.slots}
    with torch._C.DisableTorchFunctionSubclass():  # past the placeholder's guard against reading it
        # (a released parameter is a meta tensor: its storage has a size and no memory)
        params = sum(p.untyped_storage().nbytes() for n, p in engine.module.named_parameters()
                     if n.removeprefix("module.") in frozen_names and not p.is_meta)
    return {
        # every chunk the store holds lies in its one shard tensor, which holds nothing else
        "store": flat.store.device_shard.untyped_storage().nbytes(),
        "store_chunks": sum(flat.store.view(b).numel() for b in flat.layout.buckets
                            if flat.store.view(b) is not None) * flat.store.device_shard.element_size(),
        "frozen_chunks": sum(c.numel() * c.element_size() for c in chunks if c is not None),
        # the gathered buffers and the parameters themselves hold nothing of it between steps: what
        # the buffers still have resident is parked for the next gather (host/page_reserve.py)
        "frozen_gathered": sum(flat.held_bytes(b.index) for b in frozen),  # resident pages, measured
        "parked": flat.buffer_memory.parked_bytes,
        "frozen_params": params,
        "frozen_model_bytes": sum(b.numel for b in frozen) * flat.store.device_shard.element_size(),
        "frozen_buckets": len(frozen),
    }


Case = tuple[str, int, int, str, bool]
#: (kind, stage, world, precision, pretrained), all extended
CASES: list[Case] = [
    ("llama", 3, 2, "fp32", True),  # the whole path: from_pretrained under Init, LoRA, export
    ("llama", 0, 2, "fp32", False), ("llama", 3, 2, "bf16", False),
    ("llama", 2, 2, "fp32", False), ("gpt2", 3, 2, "fp32", False),
    ("llama", 1, 2, "fp32", False),
]


def cases_of(world: int) -> list[Case]:
    return [c for c in CASES if c[2] == world]


def labels(kind: str, stage: int, world: int, precision: str, pretrained: bool) -> dict[str, Any]:
    return {"kind": kind, "stage": stage, "world": world, "precision": precision, "pretrained": pretrained}


def case_dir(root: Path, kind: str, stage: int, world: int, precision: str, pretrained: bool) -> Path:
    """Each case's own directory: the base it reads, the adapters and the checkpoint it writes."""
    return root / f"{kind}_stage{stage}_world{world}_{precision}{'_pretrained' if pretrained else ''}"


def peft_worker(rank: int, world: int, cases: list[Case], root: str) -> dict:
    """Every case of this world size in turn, each named in anything it raises; the results by case."""
    out = {}
    for kind, stage, _, precision, pretrained in cases:
        with case(**labels(kind, stage, world, precision, pretrained)):
            torch.manual_seed(0)
            directory = str(case_dir(Path(root), kind, stage, world, precision, pretrained))
            out[(kind, stage, world, precision, pretrained)] = peft_case(
                rank, world, directory, kind, stage, precision, pretrained)
    return out


def run_cases(world: int, root: Path) -> list[dict]:
    """One world for every case of this size (the bases the pretrained cases read, saved first)."""
    cases = cases_of(world)
    for kind, stage, _, precision, pretrained in cases:
        if pretrained:
            base(kind).save_pretrained(str(case_dir(root, kind, stage, world, precision, pretrained) / "base"))
    return run_world(peft_worker, world, args=(cases, str(root)), timeout=600)


@pytest.fixture(scope="module")
def peft_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("peft")


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
@pytest.mark.parametrize("world", [2])
def test_peft_lora_trains_as_one_process_and_its_adapter_loads(world: int, peft_root: Path) -> None:
    results = run_cases(world, peft_root)
    failures = CaseFailures()
    for kind, stage, _, precision, pretrained in cases_of(world):
        with failures.case(**labels(kind, stage, world, precision, pretrained)):
            check_case([r[(kind, stage, world, precision, pretrained)] for r in results], kind, stage, world,
                       precision, case_dir(peft_root, kind, stage, world, precision, pretrained))
    failures.raise_any()


def check_case(results: list[dict], kind: str, stage: int, world: int, precision: str, directory: Path) -> None:
    """One case's results, by rank: trained as one process would, sharded, its adapters loadable."""
    expected = reference(kind, world)
    got = results[0]["state"]
    assert set(got) == set(expected)
    if precision == "fp32":
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    else:  # bf16 computes in 8 bits of mantissa: the deviation from the fp32 run relative to how far
        # training moved the adapters (as in test_mixed_precision.py, bound 0.06); the base is frozen
        initial = lora(kind).state_dict()
        trained = [n for n in expected if "lora_" in n]
        moved = sum(float((expected[n] - initial[n]).norm()) ** 2 for n in trained) ** 0.5
        deviation = sum(float((got[n].float() - expected[n]).norm()) ** 2 for n in trained) ** 0.5
        # the bf16 weights are the fp32 masters rounded: that rounding alone is a floor on the deviation
        rounding = sum(float((expected[n].to(torch.bfloat16).float() - expected[n]).norm()) ** 2
                       for n in trained) ** 0.5
        assert deviation <= 0.06 * moved + 2 * rounding, (deviation, moved, rounding)
        for name in expected:
            if name not in trained:
                assert torch.equal(got[name], initial[name].to(got[name].dtype)), name
    if stage == 3:  # the frozen base is sharded: each rank holds its share of it
        assert sum(r["frozen_shard_numel"] for r in results) == results[0]["frozen_numel"] > 0
        assert all(r["frozen_shard_numel"] <= -(-results[0]["frozen_numel"] // world) + 64 for r in results)
        for r in results:  # and so do the storages: 1/N of the frozen base (plus padding), nothing else
            held = r["storage"]
            assert held["store"] == held["store_chunks"] and held["frozen_params"] == 0
            assert held["frozen_gathered"] <= held["parked"]
            padding = held["frozen_chunks"] * world - held["frozen_model_bytes"]  # < N elements a bucket
            assert 0 <= padding <= held["frozen_buckets"] * (world - 1) * 4 and held["frozen_model_bytes"] > 0
    # both adapters load into a fresh base with peft, and give the trained model's weights
    offline = directory / "consolidated_adapter"
    made = subprocess.run([sys.executable, "-m", "zeroshard.tools.cli", "consolidate", str(directory / "ckpt"), str(offline),
                           "--tag", "lora", "--trainable-only"], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    assert json.loads((offline / "adapter_config.json").read_text())["r"] == 4
    for adapter in (directory / "live_adapter", offline):
        loaded = peft.PeftModel.from_pretrained(base(kind), str(adapter))
        for name, value in loaded.state_dict().items():
            if "lora_" in name:
                # (the checkpoint holds the fp32 masters: rounded, they are the trained bf16 weights)
                assert torch.equal(value.to(got[name].dtype), got[name]), (adapter.name, name)
