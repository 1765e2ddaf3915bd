"""Hugging Face model surgery through the DeepSpeed door: zeroshard installed as ``deepspeed``, ZeRO-3 on.

transformers then wraps its own reads and writes of the weights in ``deepspeed.zero.GatheredParameters``
(zeroshard's); a Llama built under ``deepspeed.zero.Init`` must come out of ``resize_token_embeddings``
(with and without ``mean_resizing``, tied and untied), ``init_weights`` and ``to(bfloat16)`` equal to the
unsharded model.  The ranks install zeroshard as ``deepspeed`` before importing transformers, so this
module imports neither at the top.
"""

from __future__ import annotations

import importlib.util
import itertools
from typing import Any

import pytest
import torch

from zeroshard.tools.testing import run_world

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")


def values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.gather_full() if hasattr(p, "gather_full") else p.detach()).clone()
            for n, p in model.named_parameters(remove_duplicate=False)}


def deepspeed_door_worker(rank: int, world: int) -> dict[str, str]:
    import zeroshard
    zeroshard.install_as_deepspeed()
    import deepspeed
    import transformers
    from transformers.integrations import HfDeepSpeedConfig

    ds_config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    keep_alive = HfDeepSpeedConfig(ds_config)  # transformers sees ZeRO-3 while this object lives
    assert keep_alive.is_zero3()
    cases = {
        "resize": lambda m: m.resize_token_embeddings(1013, mean_resizing=False),
        "resize mean_resizing": lambda m: m.resize_token_embeddings(1013),
        "init_weights": lambda m: m.apply(m._init_weights),
        "to bf16": lambda m: m.to(torch.bfloat16),
    }
    results = {}
    for (name, case), tied in itertools.product(cases.items(), (False, True)):
        cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
        torch.manual_seed(0)
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            ours = transformers.LlamaForCausalLM(cfg)
        torch.manual_seed(0)
        plain = transformers.LlamaForCausalLM(cfg)
        for model in (ours, plain):
            torch.manual_seed(5)
            case(model)
        a, b = values(ours), values(plain)
        differs = [n for n in b if n not in a or a[n].shape != b[n].shape or not torch.equal(a[n], b[n])]
        if ours.config.vocab_size != plain.config.vocab_size:
            differs.append("config.vocab_size")
        results[f"{name} ({'tied' if tied else 'untied'})"] = ", ".join(differs)
    return results


def test_surgery_through_the_deepspeed_door_equals_the_unsharded_model() -> None:
    for rank, results in enumerate(run_world(deepspeed_door_worker, 2, timeout=300)):
        assert {k: v for k, v in results.items() if v} == {}, f"rank {rank}"
