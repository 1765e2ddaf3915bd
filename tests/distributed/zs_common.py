"""Shared pieces of the distributed tests: the model, the data, and the DDP + AdamW reference."""

from __future__ import annotations

import collections
import contextlib
import copy
import traceback
from typing import Any, Iterator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroshard
from zeroshard.tools.demo.model import GPT, GPTConfig
from zeroshard.tools.selftest.syncs import site_path

# A vocabulary no world size divides, a tied embedding, and a frozen layer (see make_model).
TINY = GPTConfig(vocab_size=61, seq_len=8, d_model=16, n_layer=2, n_head=2, attn_bias=False)
LR, WD, CLIP = 1e-3, 0.1, 0.05


def make_model(seed: int = 0, cfg: GPTConfig = TINY) -> GPT:
    torch.manual_seed(seed)
    model = GPT(cfg)
    model.blocks[0].fc.requires_grad_(False)  # a frozen layer
    return model


def global_batch(step: int, rows: int, cfg: GPTConfig = TINY) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def rank_micro_batches(step: int, rank: int, world: int, micro: int, accum: int):
    """The micro batches of ``rank`` at ``step``: the global batch split by rank, then by micro step."""
    x, y = global_batch(step, micro * accum * world)
    per_rank = micro * accum
    xs, ys = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
    return [(xs[m * micro:(m + 1) * micro], ys[m * micro:(m + 1) * micro]) for m in range(accum)]


def zero_config(stage: int, micro: int, accum: int, **zero: Any) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": CLIP,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000, "allgather_bucket_size": 5000, **zero},
    }


def train_ddp(model: nn.Module, rank: int, world: int, steps: int, micro: int, accum: int,
              losses: list | None = None, **adamw: Any):
    """The reference: DistributedDataParallel + torch.optim.AdamW + clip_grad_norm_ (``losses`` collects
    every micro step's loss; ``adamw``: more of AdamW's arguments, e.g. ``amsgrad=True``)."""
    ddp = DDP(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD, **adamw)
    norms = []
    for step in range(steps):
        batches = rank_micro_batches(step, rank, world, micro, accum)
        for m, (x, y) in enumerate(batches):
            with ddp.no_sync() if m < accum - 1 else contextlib.nullcontext():  # forward inside, as DDP wants
                loss = ddp(x, y)
                (loss / accum).backward()
            if losses is not None:
                losses.append(float(loss.detach()))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms


def train_zero(model: nn.Module, rank: int, world: int, steps: int, micro: int, accum: int, stage: int,
               top: dict | None = None, **zero: Any):
    """``top``: top-level config keys beside ``zero_config``'s; ``zero``: zero_optimization keys."""
    engine, _, _, _ = zeroshard.initialize(model=model, config={**zero_config(stage, micro, accum, **zero),
                                                                **(top or {})})
    norms = []
    for step in range(steps):
        for x, y in rank_micro_batches(step, rank, world, micro, accum):
            engine.backward(engine(x, y))
            engine.step()
        norms.append(engine.get_global_grad_norm())
    return engine, norms


def max_rel_diff(a: nn.Module, b: nn.Module) -> float:
    """max over parameters of max|a - b| / max|b|: relative to each tensor's scale."""
    worst = 0.0
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        scale = float(pb.detach().abs().max()) or 1.0
        worst = max(worst, float((pa.detach() - pb.detach()).abs().max()) / scale)
    return worst


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def single_process_reference(steps: int, world: int, micro: int, accum: int) -> dict[str, torch.Tensor]:
    """One process on the whole global batch (``world`` ranks x ``accum`` micro batches of ``micro`` rows),
    AdamW and clipping, as the ranks of ``rank_micro_batches`` together see it."""
    model = make_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    per_rank = micro * accum
    for step in range(steps):
        x, y = global_batch(step, per_rank * world)
        for m in range(accum):  # the accumulation: the rows every rank takes at micro step m, averaged
            rows = torch.cat([torch.arange(r * per_rank + m * micro, r * per_rank + (m + 1) * micro)
                              for r in range(world)])
            (model(x[rows], y[rows]) / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


#: what reads a tensor's value on the host: on a GPU each waits for everything queued before it
HOST_READS = ("item", "__float__", "__bool__", "__int__", "__index__", "tolist", "cpu", "numpy")
#: modules whose reads are of host tensors by design (their own gloo groups), never a device's
HOST_ONLY = ("distributed/consistency.py", "sharding/stage3/gather_agreement.py", "distributed/ring")


@contextlib.contextmanager
def host_reads() -> Iterator[collections.Counter]:
    """Count the host reads of tensor values zeroshard makes inside the block, by ``module:function``
    of the innermost frame in the package's own files (``site_path``: wherever the checkout is, whatever
    its folder's name; reads of modules in ``HOST_ONLY`` left out)."""
    found: collections.Counter = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(name: str) -> Any:
        original = originals[name]

        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            for frame in reversed(traceback.extract_stack()[:-1]):
                site = site_path(frame.filename)  # zeroshard/... for the package's own files only
                if site.startswith("zeroshard/"):
                    module = site.removeprefix("zeroshard/")
                    if not module.startswith(HOST_ONLY):
                        found[f"{module}:{frame.name}"] += 1
                    break
            return original(self, *args, **kwargs)
        return read

    for name in HOST_READS:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield found
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
