"""Loading a ~1 GB pretrained model at world 2: per-rank peak RSS growth and time, zeroshard against a
plain ``from_pretrained`` on every rank.

    .venv/bin/python benchmarks/bench_pretrained.py [--out benchmarks/out/pretrained.json]

A Llama-shaped model (hidden 1024, 16 layers, MLP 2816, vocab 32000: 270M parameters, 1.08 GB in fp32)
is saved once as safetensors in a temporary directory.  Then, two processes at a time (gloo), each in
a fresh process:

- **plain**: every rank ``AutoModelForCausalLM.from_pretrained(dir)`` (what a script does before
  ``deepspeed.initialize`` without zero.Init), then one read of every weight (transformers maps the
  file: the parameters point into the mapping and become resident when first read, in the first
  forward or when ``initialize`` copies them);
- **zeroshard**: every rank builds the model under ``zeroshard.Init`` with ``from_config`` (Hugging
  Face's ``no_init_weights``: nothing randomly initialised), then ``zeroshard.load_pretrained(model,
  dir)`` reads its own slices, then ``zeroshard.initialize`` (stage 3) takes the shards over;
- **from_pretrained under Init**: ``with zeroshard.Init(): from_pretrained(dir)`` (transformers hands
  every weight over as a view into its mapping of the file; Init keeps each rank's slice as it is
  assigned and gives the mapped pages back).

Recorded per rank: RSS growth from just before the step to the peak (``VmHWM``, reset through
``/proc/self/clear_refs`` before each step), for the build, the load and the whole, and the seconds
each takes.  The page cache is warm for both (the file was just written and read once): this compares
memory and CPU work, not disk speed.  Every worker reads the config and imports the model's class
before measuring (``warm_up``), so transformers' lazy import of its modelling code counts for none.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
             num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> int:
    """Reset the peak RSS to the current RSS; return the current RSS in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def peak() -> int:
    return _status_kib("VmHWM") * 1024


def measured(step: Any) -> tuple[Any, dict[str, float]]:
    before = reset_peak()
    start = time.perf_counter()
    result = step()
    return result, {"growth_gb": (peak() - before) / 1e9, "seconds": time.perf_counter() - start}


def warm_up(directory: str) -> None:
    """Read the config and import the model's class before measuring, in every worker alike: what the
    first ``from_pretrained`` of a process would otherwise count is transformers' lazy import of the
    modelling code, not the weights."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory)
    transformers.AutoModelForCausalLM._model_mapping[type(config)]


def plain_worker(rank: int, world: int, directory: str) -> dict:
    import torch
    import transformers

    torch.set_num_threads(1)
    warm_up(directory)
    model, load = measured(lambda: transformers.AutoModelForCausalLM.from_pretrained(directory))
    # transformers maps the file and its parameters point into the mapping: nothing is resident until
    # the weights are first read (the first forward). Read each once, as training will.
    _, touched = measured(lambda: sum(float(p.detach().sum()) for p in model.parameters()))
    return {"load": load, "first_read": touched,
            "load_and_read": {"growth_gb": load["growth_gb"] + touched["growth_gb"],
                              "seconds": load["seconds"] + touched["seconds"]}}


def hf_under_init_worker(rank: int, world: int, directory: str) -> dict:
    import torch
    import transformers

    import zeroshard

    torch.set_num_threads(1)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    warm_up(directory)

    def load() -> Any:
        with zeroshard.Init(config=config):
            return transformers.AutoModelForCausalLM.from_pretrained(directory)
    _, measured_load = measured(load)
    return {"load": measured_load}


def zeroshard_worker(rank: int, world: int, directory: str) -> dict:
    import torch
    import transformers
    from transformers.initialization import no_init_weights

    import zeroshard

    torch.set_num_threads(1)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
              "zero_optimization": {"stage": 3}}
    cfg = transformers.AutoConfig.from_pretrained(directory)
    warm_up(directory)
    start = reset_peak()

    def build() -> Any:
        with no_init_weights(), zeroshard.Init(config=config):
            return transformers.AutoModelForCausalLM.from_config(cfg)
    model, build_m = measured(build)
    kept_after_build = _status_kib("VmRSS") * 1024 - start
    _, load_m = measured(lambda: zeroshard.load_pretrained(model, directory))
    # the peak of build + load, from before the build: the build's peak, or what the build kept plus
    # the load's own peak (VmHWM is reset before each step)
    whole = {"growth_gb": max(build_m["growth_gb"], kept_after_build / 1e9 + load_m["growth_gb"]),
             "seconds": build_m["seconds"] + load_m["seconds"]}
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    shard_bytes = engine.memory_breakdown()["params"]
    engine.close()
    return {"build": build_m, "load": load_m, "build_and_load": whole, "shard_gb": shard_bytes / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "pretrained.json"))
    args = parser.parse_args()
    import torch
    import transformers

    from zeroshard.tools.testing import run_world

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE))
        numel = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp)
        del model
        model_gb = sum(p.stat().st_size for p in Path(tmp).glob("*.safetensors")) / 1e9
        largest_gb = 32000 * 1024 * 4 / 1e9
        plain = run_world(plain_worker, 2, args=(tmp,), timeout=1200)
        ours = run_world(zeroshard_worker, 2, args=(tmp,), timeout=1200)
        hf_init = run_world(hf_under_init_worker, 2, args=(tmp,), timeout=1200)
    result = {"params": numel, "model_gb": model_gb, "largest_tensor_gb": largest_gb, "plain": plain,
              "zeroshard": ours, "from_pretrained_under_init": hf_init}
    print(f"\n{numel / 1e6:.0f}M parameters, {model_gb:.2f} GB of safetensors (fp32), world 2; per rank:\n")
    print("| rank | plain from_pretrained: GB / s | + first read of every weight: GB (x model) / s | "
          "zeroshard Init build: GB / s | load_pretrained: GB / s | build + load: GB (x model) / s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rank in range(2):
        p, z = plain[rank]["load_and_read"], ours[rank]
        both = z["build"]["seconds"] + z["load"]["seconds"]
        print(f"| {rank} | {plain[rank]['load']['growth_gb']:.2f} / {plain[rank]['load']['seconds']:.1f} | "
              f"{p['growth_gb']:.2f} ({p['growth_gb'] / model_gb:.2f}x) / {p['seconds']:.1f} | "
              f"{z['build']['growth_gb']:.2f} / {z['build']['seconds']:.1f} | "
              f"{z['load']['growth_gb']:.3f} / {z['load']['seconds']:.1f} | "
              f"{z['build_and_load']['growth_gb']:.2f} ({z['build_and_load']['growth_gb'] / model_gb:.2f}x) / "
              f"{both:.1f} |")
    print(f"\nshard per rank after initialize: {ours[0]['shard_gb']:.2f} GB; largest tensor {largest_gb:.2f} GB")
    for rank in range(2):
        h = hf_init[rank]["load"]
        print(f"rank {rank}: `with zeroshard.Init(): from_pretrained(dir)`: {h['growth_gb']:.2f} GB "
              f"({h['growth_gb'] / model_gb:.2f}x) / {h['seconds']:.1f} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
