"""Parameters built under ``zeroshard.Init``: every operation equals the unsharded one or raises a named error.

The guard of [Note: what an Init-built parameter does with each operation] (sharding/stage3/init_param.py):
one world of two ranks walks a list of operations, tied and untied embeddings, fp32 and bf16, users make on a model between construction and
``initialize()`` — writes through ``.data``, item assignment, ``.data = t`` of another shape, a read
on one rank only, and Hugging Face's model surgery (``resize_token_embeddings``, ``tie_weights``,
``init_weights``, ``to(dtype)``, ``get_peft_model``, ``state_dict``/``load_state_dict``,
``save_pretrained``) — and checks each against the same operation on the plain model: equal values,
or a ``ShardedParameterError``; never a hang (the world has a timeout) and never a silent difference.
Then a model resized under Init trains at stage 3 equal to DDP on the plain resized model, and the same
operations on a live stage-3 engine's model either raise by name or leave it training like DDP.

The world of two runs these families in turn (``run_family``), each from the same seed; the test
then checks every one, and a failure names it: its check, stage, world size, precision and arguments.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroshard
from zeroshard.engine.engine import ModelChangedError
from zeroshard.tools.testing import Case, check_family, run_family

transformers = pytest.importorskip("transformers")

VOCAB, NEW_VOCAB = 1000, 1013


def llama(tied: bool) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                   tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(cfg)


def sharded_llama(tied: bool) -> nn.Module:
    with zeroshard.Init():
        return llama(tied)


def full_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full values: gathered (a collective every rank makes) or plain."""
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = p.gather_full().clone() if hasattr(p, "gather_full") else p.detach().clone()
    return out


def same(ours: nn.Module, plain: nn.Module) -> str:
    """'' when both models have the same parameters, shapes, config and values; else what differs."""
    a, b = full_values(ours), full_values(plain)
    if list(a) != list(b):
        return f"names differ: {sorted(set(a) ^ set(b))}"
    for name in a:
        if a[name].shape != b[name].shape or a[name].dtype != b[name].dtype:
            return f"{name}: {tuple(a[name].shape)} {a[name].dtype} vs {tuple(b[name].shape)} {b[name].dtype}"
        if not torch.equal(a[name], b[name]):
            return f"{name}: values differ by {float((a[name].float() - b[name].float()).abs().max())}"
    if getattr(ours, "config", None) is not None and ours.config.vocab_size != plain.config.vocab_size:
        return f"config.vocab_size {ours.config.vocab_size} vs {plain.config.vocab_size}"
    return ""


def resize(**kwargs: Any) -> Callable[[nn.Module, bool], None]:
    """Resizing reads the old rows: inside an Init block (every rank runs it) on the sharded model."""
    def apply(model: nn.Module, sharded: bool) -> None:
        torch.manual_seed(5)  # the new rows are random: the same generator state on both models
        if sharded:
            with zeroshard.Init():
                model.resize_token_embeddings(**kwargs)
        else:
            model.resize_token_embeddings(**kwargs)
    return apply


def surgery_cases() -> dict[str, Callable[[nn.Module, bool], Any]]:
    def init_weights(model: nn.Module, sharded: bool) -> None:
        torch.manual_seed(3)
        model.apply(model._init_weights)

    def write_through_data(model: nn.Module, sharded: bool) -> None:
        w = model.model.layers[0].mlp.up_proj.weight
        w.data.copy_(torch.arange(w.numel(), dtype=w.dtype).view(w.shape))
        w.data[0:10] = 7.0
        with torch.no_grad():
            w[3].zero_()
            w.mul_(2)

    def assign_other_shape(model: nn.Module, sharded: bool) -> None:
        model.model.layers[1].mlp.down_proj.weight.data = torch.linspace(0, 1, 16 * 40).view(16, 40)

    def load_plain_state(model: nn.Module, sharded: bool) -> None:
        state = llama(tied=False).state_dict()
        model.load_state_dict({k: v * 0.5 for k, v in state.items()})

    def peft(model: nn.Module, sharded: bool) -> nn.Module:
        peft_lib = pytest.importorskip("peft")
        torch.manual_seed(4)
        return peft_lib.get_peft_model(model, peft_lib.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))

    return {
        "resize 1013": resize(new_num_tokens=NEW_VOCAB, mean_resizing=False),
        "resize 1013 mean_resizing": resize(new_num_tokens=NEW_VOCAB, mean_resizing=True),
        "resize pad_to_multiple_of 8": resize(new_num_tokens=NEW_VOCAB, pad_to_multiple_of=8, mean_resizing=False),
        "shrink 990": resize(new_num_tokens=990),
        "tie_weights": lambda m, s: m.tie_weights(),
        "init_weights": init_weights,
        "gradient_checkpointing_enable": lambda m, s: m.gradient_checkpointing_enable(),
        "to bf16": lambda m, s: m.to(torch.bfloat16),
        "writes through .data": write_through_data,
        ".data = t of another shape": assign_other_shape,
        "load_state_dict": load_plain_state,
        "get_peft_model": peft,
    }


def guard_worker(rank: int, world: int, directory: str) -> dict[str, str]:
    """For each case and tied/untied: '' (equal to unsharded), 'raised: ...' or what differs."""
    results: dict[str, str] = {}
    for tied, dtype in itertools.product((False, True), (torch.float32, torch.bfloat16)):
        for name, operation in surgery_cases().items():
            key = f"{name} ({'tied' if tied else 'untied'}, {dtype})"
            ours, plain = sharded_llama(tied).to(dtype), llama(tied).to(dtype)
            try:
                ours = operation(ours, True) or ours
            except zeroshard.ShardedParameterError as error:
                results[key] = f"raised: {error}"
                continue
            plain = operation(plain, False) or plain
            results[key] = same(ours, plain)
        model = sharded_llama(tied)
        results[f"num_parameters ({tied}, {dtype})"] = "" if model.num_parameters() == llama(tied).num_parameters() else "differs"
        for name, read in (("state_dict read", lambda m: float(m.state_dict()["lm_head.weight"].sum())),
                           ("save_pretrained", lambda m: m.save_pretrained(f"{directory}/rank{rank}"))):
            try:
                read(model)
                results[f"{name} ({tied}, {dtype})"] = "no error"
            except zeroshard.ShardedParameterError as error:
                results[f"{name} ({tied}, {dtype})"] = f"raised: {error}"
    # a read made by one rank only returns at once with a named error there; the other rank goes on
    model = sharded_llama(tied=False)
    if rank == 0:
        try:
            print(float(model.lm_head.weight.detach().sum()))
            results["lone read"] = "no error"
        except zeroshard.ShardedParameterError as error:
            results["lone read"] = f"raised: {error}"
    with zeroshard.GatheredParameters(model.lm_head.weight):
        results["read inside GatheredParameters"] = "" if model.lm_head.weight.shape == (VOCAB, 16) and \
            torch.isfinite(model.lm_head.weight.sum()) else "wrong"
    return results


MUST_WORK = ("resize 1013", "resize 1013 mean_resizing", "resize pad_to_multiple_of 8", "shrink 990", "tie_weights",
             "init_weights", "gradient_checkpointing_enable", "to bf16", "writes through .data",
             ".data = t of another shape", "load_state_dict", "get_peft_model", "num_parameters",
             "read inside GatheredParameters")
MUST_RAISE = ("state_dict read", "save_pretrained")


def check_operations_on_init_built_parameters_equal_unsharded_or_raise_by_name(
        by_rank: list[dict[str, str]]) -> None:
    for rank, results in enumerate(by_rank):
        for key, outcome in results.items():
            if key.startswith(MUST_WORK):
                assert outcome == "", f"rank {rank}, {key}: {outcome}"
            elif key.startswith(MUST_RAISE):
                assert outcome.startswith("raised: ") and "GatheredParameters" in outcome, f"rank {rank}, {key}"
        if rank == 0:
            assert results["lone read"].startswith("raised: "), results["lone read"]
        else:
            assert "lone read" not in results


def resized_training_worker(rank: int, world: int, directory: str, tied: bool, bf16: bool) -> float:
    """Resized under Init, then stage 3: equal to DDP on the plain model resized the same way."""
    ours, plain = sharded_llama(tied), llama(tied)
    resize(new_num_tokens=NEW_VOCAB, mean_resizing=False)(ours, True)
    resize(new_num_tokens=NEW_VOCAB, mean_resizing=False)(plain, False)
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
                              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
                              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 64}}
    if bf16:
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = zeroshard.initialize(model=ours, config=config)
    ddp = DDP(plain)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.0)
    for step in range(3):
        ids = torch.randint(0, NEW_VOCAB, (2, 8), generator=torch.Generator().manual_seed(step * 10 + rank))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        ddp(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    state = engine.full_state_dict(rank0_only=False)
    engine.close()
    worst = 0.0
    for name, value in plain.state_dict().items():
        got = state[name].float()
        worst = max(worst, float((got - value).abs().max()) / (float(value.abs().max()) or 1.0))
    assert state["model.embed_tokens.weight"].shape == (NEW_VOCAB, 16)
    return worst


def check_a_model_resized_under_init_trains_at_stage_3_like_ddp(by_rank: list[float], tied: bool,
                                                                bf16: bool) -> None:
    for worst in by_rank:
        assert worst <= 1e-5


def engine_cases() -> dict[str, Callable[[nn.Module], Any]]:
    """Operations on the model of a live stage-3 engine, whose parameters are released placeholders."""
    def peft(model: nn.Module) -> None:
        peft_lib = pytest.importorskip("peft")
        peft_lib.get_peft_model(model, peft_lib.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))

    return {
        "resize": lambda m: m.resize_token_embeddings(NEW_VOCAB),
        "state_dict read": lambda m: float(m.state_dict()["lm_head.weight"].sum()),
        "load_state_dict": lambda m: m.load_state_dict(llama(tied=False).state_dict(), strict=False),
        "to bf16": lambda m: m.to(torch.bfloat16),
        "init_weights": lambda m: m.apply(m._init_weights),
        "get_peft_model": peft,
        "a new head": lambda m: setattr(m, "value_head", nn.Linear(16, 1)),
        "gradient_checkpointing_enable": lambda m: m.gradient_checkpointing_enable(),
        "tie_weights": lambda m: m.tie_weights(),
    }


#: what each operation on a live engine's model must do: raise a named error at once, or leave an engine
#: that still trains like DDP
ENGINE_EXPECTED = {"resize": "raised", "state_dict read": "raised", "load_state_dict": "raised",
                   "to bf16": "raised", "init_weights": "raised", "get_peft_model": "raised",
                   "a new head": "refused at forward",
                   "gradient_checkpointing_enable": "trains", "tie_weights": "trains"}
#: where a case's outcome depends on the engine's precision: a bf16 engine's model is already bf16, so
#: ``to(bf16)`` moves and converts nothing (see [Note: operations a placeholder answers without its
#: values] in sharding/stage3/placeholder.py)
ENGINE_EXPECTED_AT = {"to bf16 (untied, bf16)": "trains", "to bf16 (tied, bf16)": "trains"}


def engine_guard_worker(rank: int, world: int, directory: str) -> dict[str, str]:
    results = {}
    for (name, operation), tied, bf16 in itertools.product(engine_cases().items(), (False, True), (False, True)):
        config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
                                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 64}}
        if bf16:
            config["bf16"] = {"enabled": True}
        plain, ours = llama(tied), llama(tied)
        engine, _, _, _ = zeroshard.initialize(model=ours, config=config)
        key = f"{name} ({'tied' if tied else 'untied'}, {'bf16' if bf16 else 'fp32'})"
        try:
            operation(engine.module)
        except RuntimeError as error:  # torch's load_state_dict wraps the error it met in its own
            named = isinstance(error, zeroshard.ShardedParameterError) or "GatheredParameters" in str(error)
            results[key] = "raised" if named else f"raised {error!r}"
            engine.close()
            continue
        ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
        try:
            engine.backward(engine(input_ids=ids, labels=ids).loss)
        except ModelChangedError:
            results[key] = "refused at forward"
            engine.close()
            continue
        engine.step()
        if not bf16:  # one step of DDP on the plain model, the same operation applied
            operation(plain)
            ddp = DDP(plain)
            opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.0)
            ddp(input_ids=ids, labels=ids).loss.backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
            opt.step()
            state = engine.full_state_dict(rank0_only=False)
            worst = max(float((state[k] - v).abs().max()) / (float(v.abs().max()) or 1.0)
                        for k, v in plain.state_dict().items())
            results[key] = "trains" if worst <= 1e-5 else f"off by {worst:.2e}"
        else:
            results[key] = "trains"
        engine.close()
    return results


def check_operations_on_a_stage_3_engines_model_raise_by_name_or_train_like_ddp(
        by_rank: list[dict[str, str]]) -> None:
    for rank, results in enumerate(by_rank):
        for key, outcome in results.items():
            expected = ENGINE_EXPECTED_AT.get(key, ENGINE_EXPECTED[key.split(" (")[0]])
            assert outcome == expected, f"rank {rank}, {key}: {outcome}"


GUARD = "operations_on_init_built_parameters_equal_unsharded_or_raise_by_name"
RESIZED = "a_model_resized_under_init_trains_at_stage_3_like_ddp"
ENGINE_GUARD = "operations_on_a_stage_3_engines_model_raise_by_name_or_train_like_ddp"
#: each case's worker (called with the case's own directory first), and the check of its results (one per rank)
WORKERS: dict[str, Callable[..., Any]] = {GUARD: guard_worker, RESIZED: resized_training_worker,
                                          ENGINE_GUARD: engine_guard_worker}
CHECKS: dict[str, Callable[..., None]] = {
    GUARD: check_operations_on_init_built_parameters_equal_unsharded_or_raise_by_name,
    RESIZED: check_a_model_resized_under_init_trains_at_stage_3_like_ddp,
    ENGINE_GUARD: check_operations_on_a_stage_3_engines_model_raise_by_name_or_train_like_ddp,
}
#: (a case of the family: the name of its check and its arguments); the guards try fp32 and bf16 each
CASES: list[Case] = [
    (GUARD, {}), (RESIZED, {"tied": False, "bf16": False}), (RESIZED, {"tied": True, "bf16": False}),
    (ENGINE_GUARD, {})]


def labels(name: str, world: int, arguments: dict[str, Any]) -> dict[str, Any]:
    """How a case is named in failures: its check, stage, world size, precision and other arguments."""
    rest = dict(arguments)
    precision = ("bf16" if rest.pop("bf16") else "fp32") if "bf16" in rest else "fp32 and bf16"
    return {"check": name, "stage": 3, "world": world, "precision": precision, **rest}


def test_init_surgery_cases(tmp_path: Path) -> None:
    """In a world of 2: operations on Init-built parameters equal the unsharded ones or raise by name; a
    model resized under Init trains at stage 3 like DDP (untied and tied embeddings); operations on a
    stage-3 engine's model raise by name or train like DDP."""
    world = 2
    by_rank = run_family(world, CASES, WORKERS, labels=labels, root=tmp_path)  # a directory per worker; checks need none
    check_family(CASES, by_rank, CHECKS, world, labels=labels)
