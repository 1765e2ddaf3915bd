"""Pipeline parallelism with ZeRO: ``train_batch`` against one process training the same layers.

One world of 4 ranks runs every case: pipeline 2 x data 2 at ZeRO stages 0-3 with each schedule
(interleaved 1F1B with two and three chunks per stage too), pipeline 4 x data 1, evaluation, checkpoints saved at one split and resumed at others (and read as one
``nn.Sequential``), periodic saves, bf16, fp16 (against zeroshard's own engine in one process) and an
overflow on one rank that every rank skips, CPU offload, ``initialize(resume_from=...)`` and
``checkpoint.auto_resume`` (a fresh start, then a resume with the engine's loader), ZeRO-3 with every
parameter sharded and each batch's all-gathers counted (a stage's units gathered once per batch, or once
per micro-batch and pass with ``pipeline.stage3_gather_per_micro_batch``), ZeRO++ at stage 3 (qwZ's int8
gathers and qgZ's quantised reductions over each stage's data-parallel pair, each moving one chunk's
blocks; every loss within 0.5% of the one process's, each parameter within 10% of its norm), and the
refused inputs.  The
model has a tied embedding (first and last stage), tuples of tensors of two dtypes between stages, and a
sequence length that changes from one micro-batch to the next.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import zeroshard
from zeroshard.checkpoint.consolidate import consolidate, full_state_dict
from zeroshard.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from zeroshard.pipeline import (PipelineBatchSizeError, PipelineConfigError, PipelineUsageError, StagesDoNotDivideError,
                                TiedChunkError, TooFewLayersError)
from zeroshard.tools.testing import check_family, run_family

V, D, MICRO, ACCUM, STEPS, LR, WD, CLIP = 23, 8, 2, 3, 5, 1e-2, 0.1, 0.5


class Positions(nn.Module):
    """Hidden states and their positions (int64): a tuple of two dtypes travels between stages."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, torch.arange(x.shape[1]).expand(x.shape[0], -1)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, pos = inputs
        return x + torch.tanh(self.fc(x)) * (1 + pos.unsqueeze(-1) % 3), pos


def drop_positions(inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return inputs[0]


def logits(embedding: nn.Module, x: torch.Tensor) -> Any:
    return x @ embedding.weight.t()


def loss_fn(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in fp32 whatever the logits' dtype (a bf16 loss would carry 8 bits)."""
    return nn.functional.cross_entropy(out.float().reshape(-1, V), labels.reshape(-1))


class SmallEmbedding(nn.Embedding):
    """An embedding initialized small (std 0.1), as language models initialize theirs: logits of the
    size bf16 carries to about 1e-3, as the mixed-precision bounds assume."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.1)


def specs(embedding: type = nn.Embedding, blocks: int = 3) -> list[Any]:
    return [TiedLayerSpec("embed", embedding, V, D), Positions(), *[LayerSpec(Block, D) for _ in range(blocks)],
            drop_positions, LayerSpec(nn.LayerNorm, D), TiedLayerSpec("embed", embedding, V, D, forward_fn=logits)]


def micro_batch(step: int, j: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel rank ``d``'s micro-batch ``j`` of ``step``; its length varies with ``j``."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * j + d)
    data = torch.randint(0, V, (MICRO, 4 + (step + j) % 3 + 1), generator=g)
    return data[:, :-1], data[:, 1:]


class Reference:
    """The same layers in one process (each built from the seed the pipeline uses), AdamW, accumulation."""

    def __init__(self, lr: float = LR, embedding: type = nn.Embedding, blocks: int = 3) -> None:
        self.calls: list[Any] = []
        self.modules: dict[int, nn.Module] = {}
        embed = None
        for index, spec in enumerate(specs(embedding, blocks)):
            if isinstance(spec, TiedLayerSpec):
                if embed is None:
                    torch.manual_seed(1234 + index)
                    embed = spec.build()
                    self.modules[index] = embed
                module = embed
                self.calls.append((lambda x, m=module, f=spec.forward_fn: f(m, x)) if spec.forward_fn else module)
            elif isinstance(spec, LayerSpec):
                torch.manual_seed(1234 + index)
                self.modules[index] = spec.build()
                self.calls.append(self.modules[index])
            else:
                self.calls.append(spec)
        params = [p for m in self.modules.values() for p in m.parameters()]
        self.params = params
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=WD)

    def forward(self, x: Any) -> Any:
        for call in self.calls:
            x = call(x)
        return x

    def train_step(self, step: int, dp: int, batch: Any = None, accum: int = ACCUM) -> float:
        total = 0.0
        for j in range(accum):
            for d in range(dp):
                x, y = (batch or micro_batch)(step, j, d)
                loss = loss_fn(self.forward(x), y)
                (loss / (accum * dp)).backward()
                total += float(loss.detach()) / (accum * dp)
        torch.nn.utils.clip_grad_norm_(self.params, CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return total

    def eval_loss(self, step: int, dp: int, accum: int = ACCUM) -> float:
        with torch.no_grad():
            return sum(float(loss_fn(self.forward(micro_batch(step, j, d)[0]), micro_batch(step, j, d)[1]))
                       for j in range(accum) for d in range(dp)) / (accum * dp)


def config(stage: int, schedule: str, dp: int, **more: Any) -> dict[str, Any]:
    return {"train_batch_size": MICRO * ACCUM * dp, "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": ACCUM, "gradient_clipping": CLIP, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
            "zero_optimization": {"stage": stage}, "pipeline": {"schedule": schedule}, **more}


def build(pp: int, stage: int, schedule: str, embedding: type = nn.Embedding, chunks: int = 1,
          **more: Any) -> tuple[Any, PipelineModule]:
    module = PipelineModule(specs(embedding, chunked_blocks(pp, chunks)), num_stages=pp, loss_fn=loss_fn, seed_layers=True,
                            partition_method="uniform" if pp * chunks == 4 else "parameters", virtual_stages=chunks)
    engine, _, _, _ = zeroshard.initialize(model=module, model_parameters=module.parameters(),
                                           config=config(stage, schedule, 4 // pp, **more))
    return engine, module


def data(step: int, d: int, accum: int = ACCUM) -> Any:
    return iter([micro_batch(step, j, d) for j in range(accum)])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def stage_param_errors(module: PipelineModule, reference: Reference) -> list[float]:
    """Each parameter this stage owns against the reference's (tied copies are not owned)."""
    errors = []
    owned: list[tuple[nn.Module, nn.Module]] = []
    for index, call in module.layer_calls().items():
        spec = module.layer_specs[index]
        if isinstance(spec, TiedLayerSpec):
            if index == 0:
                owned.append((module.tied_modules[spec.key], reference.modules[0]))
        elif index in reference.modules:
            owned.append((call, reference.modules[index]))
    for mine, theirs in owned:
        with zeroshard.GatheredParameters(list(mine.parameters())):  # read inside: stage 3's placeholders
            for p, q in zip(mine.parameters(), theirs.parameters()):
                errors.append(relative(p.detach(), q.detach()))
    return errors


#: ``offload`` of a train case: the zero_optimization keys that put the stage's optimizer (and at stage 3
#: its parameters) on the CPU
OFFLOADS: dict[str, dict[str, Any]] = {
    "optimizer": {"offload_optimizer": {"device": "cpu"}},
    "param": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}


#: micro-batches per batch with virtual stages: a multiple of the pipeline depths tested (2 and 4)
CHUNKED_ACCUM = 4


def chunked_blocks(pp: int, chunks: int) -> int:
    """Blocks in the model: 3, or with 8 virtual stages 7, so that every chunk holds a layer and every
    stage a parameter (a stage of parameter-free layers has nothing to train)."""
    return 7 if pp * chunks >= 8 else 3


def train_worker(rank: int, world: int, pp: int, stage: int, schedule: str, offload: str = "",
                 chunks: int = 1) -> dict[str, Any]:
    more: dict[str, Any] = {"zero_optimization": {"stage": stage, **OFFLOADS[offload]}} if offload else {}
    dp = 4 // pp
    accum = CHUNKED_ACCUM if chunks > 1 else ACCUM
    if chunks > 1:
        more.update(gradient_accumulation_steps=accum, train_batch_size=MICRO * accum * dp)
    engine, module = build(pp, stage, schedule, chunks=chunks, **more)
    data_rank = rank % dp
    reference = Reference(blocks=chunked_blocks(pp, chunks))
    losses, expected = [], []
    for step in range(STEPS):
        losses.append(float(engine.train_batch(data(step, data_rank, accum))))
        expected.append(reference.train_step(step, dp, accum=accum))
    errors = stage_param_errors(module, reference)
    tied_error = 0.0
    if module.tied.ties[0].copy is not None:  # a later stage's copy of the tied embedding
        tied_error = relative(module.tied.ties[0].copy.detach(), reference.modules[0].weight.detach())
    eval_loss = float(engine.eval_batch(data(STEPS, data_rank, accum)))
    engine.close()
    return {"losses": losses, "expected": expected, "errors": errors, "tied": tied_error,
            "eval": eval_loss, "eval_expected": reference.eval_loss(STEPS, dp, accum)}


def check_train(by_rank: list[dict[str, Any]], pp: int, stage: int, schedule: str, offload: str = "",
                chunks: int = 1) -> None:
    for rank, out in enumerate(by_rank):
        for got, want in zip(out["losses"], out["expected"]):
            assert abs(got - want) <= 1e-5 * abs(want), (rank, out["losses"], out["expected"])
        assert out["errors"] and max(out["errors"]) <= 1e-5, (rank, out["errors"])
        assert out["tied"] <= 1e-5, (rank, out["tied"])
        assert abs(out["eval"] - out["eval_expected"]) <= 1e-5 * abs(out["eval_expected"]), (rank, out)


#: the gathers case: pipeline 2 x data 2 at ZeRO stage 3 with GATHER_MICRO micro-batches per batch, every
#: parameter sharded (persistence threshold 0) and no unit kept for a later use by the scheduler
#: (``stage3_max_reuse_distance`` 0), so that gathering per micro-batch is one all-gather of each unit for
#: each micro-batch's forward and one for its backward
GATHER_MICRO = 4
GATHER_ZERO = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}


def gathers_worker(rank: int, world: int, schedule: str, per_micro_batch: bool, chunks: int = 1) -> dict[str, Any]:
    """Train as ``train_worker`` does and count, per batch, the all-gathers of the stage's units: the
    batch's own (``batch_gather[...]``, ``BatchGathers`` in pipeline/engine.py) and the scheduler's (``gather[...]``)."""
    from zeroshard.distributed.collectives import CommKind

    engine, module = build(2, 3, schedule, chunks=chunks, gradient_accumulation_steps=GATHER_MICRO,
                           train_batch_size=MICRO * GATHER_MICRO * 2, zero_optimization=GATHER_ZERO,
                           pipeline={"schedule": schedule, "stage3_gather_per_micro_batch": per_micro_batch})
    reference = Reference()
    losses, expected, counts = [], [], []

    def counted(log: list[Any]) -> dict[str, int]:
        gathers = [r for r in log if r.kind is CommKind.ALL_GATHER and r.group_size == 2]
        return {"batch": sum(r.label.startswith("batch_gather[") for r in gathers),
                "pass": sum(r.label.startswith("gather[") for r in gathers)}

    for step in range(STEPS):
        log = engine.comm.ledger.start_log()
        losses.append(float(engine.train_batch(data(step, rank % 2, GATHER_MICRO))))
        expected.append(reference.train_step(step, 2, accum=GATHER_MICRO))
        counts.append(counted(log))
    log = engine.comm.ledger.start_log()
    eval_loss = float(engine.eval_batch(data(STEPS, rank % 2, GATHER_MICRO)))
    eval_counts = counted(log)
    engine.comm.ledger.log = None
    errors = stage_param_errors(module, reference)
    tied_error = 0.0
    if module.tied.ties[0].copy is not None:
        tied_error = relative(module.tied.ties[0].copy.detach(), reference.modules[0].weight.detach())
    units = len(engine.strategy.scheduler.units)
    pinned_after = [i for i in engine.strategy.scheduler.units if engine.storage.pinned(i)]
    gathered_after = engine.storage.gathered_bytes()
    timing = engine.last_batch_timing
    engine.close()
    return {"losses": losses, "expected": expected, "errors": errors, "tied": tied_error, "counts": counts,
            "eval": eval_loss, "eval_expected": reference.eval_loss(STEPS, 2, GATHER_MICRO), "eval_counts": eval_counts,
            "units": units, "pinned_after": pinned_after, "gathered_after": gathered_after,
            "timing": None if timing is None else (timing.busy_s, timing.idle_s, timing.recv_s)}


def check_gathers(by_rank: list[dict[str, Any]], schedule: str, per_micro_batch: bool, chunks: int = 1) -> None:
    for rank, out in enumerate(by_rank):  # the parity of check_train
        for got, want in zip(out["losses"], out["expected"]):
            assert abs(got - want) <= 1e-5 * abs(want), (rank, out["losses"], out["expected"])
        assert out["errors"] and max(out["errors"]) <= 1e-5, (rank, out["errors"])
        assert out["tied"] <= 1e-5, (rank, out["tied"])
        units = out["units"]
        # stage 0: embedding, 2 blocks; 1: block, norm.  Two chunks: stage 0 embedding and block 4; 1: blocks
        # 2 and 3, norm
        assert units == ((3, 2) if chunks == 1 else (2, 3))[rank // 2], (rank, units)
        # once per unit and batch by default; per micro-batch, once per unit for each forward and backward
        want = {"batch": 0, "pass": 2 * GATHER_MICRO * units} if per_micro_batch else {"batch": units, "pass": 0}
        assert out["counts"] == [want] * STEPS, (rank, out["counts"], want)
        # evaluation: forwards only
        assert abs(out["eval"] - out["eval_expected"]) <= 1e-5 * abs(out["eval_expected"]), (rank, out)
        want = {"batch": 0, "pass": GATHER_MICRO * units} if per_micro_batch else {"batch": units, "pass": 0}
        assert out["eval_counts"] == want, (rank, out["eval_counts"], want)
        assert out["pinned_after"] == [] and out["gathered_after"] == 0, (rank, out)  # released by the step
        busy, idle, recv = out["timing"]
        assert busy > 0 and 0 <= recv <= idle, (rank, out["timing"])


#: ZeRO++ in the zeropp case: qgZ (4 bits) at its stage, and qwZ at stage 3, in blocks of ZEROPP_BLOCK
ZEROPP_BLOCK = 16


def zeropp_worker(rank: int, world: int, stage: int) -> dict[str, Any]:
    """Pipeline 2 x data 2 with ZeRO++: each stage's buckets reduced by qgZ over its data-parallel pair
    (one node: one all-to-all), and at stage 3 its units gathered as int8 blocks."""
    zero = {"stage": stage, "zero_quantized_gradients": True, "zero_quantized_block_size": ZEROPP_BLOCK,
            "zero_quantized_weights": stage == 3, "stage3_param_persistence_threshold": 0}
    engine, module = build(2, stage, "1f1b", zero_optimization=zero)
    log = engine.comm.ledger.start_log()
    reference = Reference()
    losses, expected = [], []
    for step in range(STEPS):
        losses.append(float(engine.train_batch(data(step, rank % 2))))
        expected.append(reference.train_step(step, 2))
    errors = stage_param_errors(module, reference)
    shards = {b.shard_numel for b in engine.storage.layout.buckets}
    quantised = [(r.kind.name, r.group_size, r.sent) for r in log if r.label.endswith((".qgz", ".qwz"))]
    engine.close()
    return {"losses": losses, "expected": expected, "errors": errors, "shards": shards, "quantised": quantised}


def check_zeropp(by_rank: list[dict[str, Any]], stage: int) -> None:
    from zeroshard.quantize import BlockFormat, packed_bytes
    sizes = {"ALL_TO_ALL": BlockFormat(4, ZEROPP_BLOCK), "ALL_GATHER": BlockFormat(8, ZEROPP_BLOCK)}
    for rank, out in enumerate(by_rank):
        kinds = {kind for kind, _, _ in out["quantised"]}
        assert kinds == ({"ALL_TO_ALL", "ALL_GATHER"} if stage == 3 else {"ALL_TO_ALL"}), (rank, kinds)
        for kind, size, sent in out["quantised"]:  # over the stage's data-parallel pair: one chunk's blocks
            assert size == 2 and sent in {packed_bytes(n, sizes[kind]) for n in out["shards"]}, (rank, kind, sent)
        for got, want in zip(out["losses"], out["expected"]):
            assert abs(got - want) <= 0.005 * abs(want), (rank, out["losses"], out["expected"])
        # each parameter against the one process's, relative to its own norm
        assert out["errors"] and max(out["errors"]) <= 0.1, (rank, out["errors"])


def refusals_worker(rank: int, world: int) -> list[str]:
    raised = []
    for attempt in (lambda: PipelineModule(specs(), num_stages=3),
                    lambda: PipelineModule(specs()[:3], num_stages=4),
                    lambda: zeroshard.initialize(model=PipelineModule(specs(), num_stages=2, loss_fn=loss_fn),
                                                 config={**config(0, "1f1b", 2), "train_batch_size": 7}),
                    # an mpu other than the module's own would be ignored: refused
                    lambda: zeroshard.initialize(model=PipelineModule(specs(), num_stages=2, loss_fn=loss_fn),
                                                 mpu=PipelineModule(specs(), num_stages=2).mpu(),
                                                 config=config(0, "1f1b", 2)),
                    # virtual stages: the interleaved schedule needs chunks, chunks need it, its micro-batches a
                    # multiple of the stages (ACCUM is 3), no per-micro-batch gathers; a tied weight first used
                    # in a later chunk
                    lambda: build(2, 0, "interleaved_1f1b"),
                    lambda: build(2, 0, "1f1b", chunks=2, gradient_accumulation_steps=4, train_batch_size=MICRO * 8),
                    lambda: build(2, 0, "interleaved_1f1b", chunks=2),
                    lambda: build(2, 3, "interleaved_1f1b", chunks=2, gradient_accumulation_steps=4,
                                  train_batch_size=MICRO * 8,
                                  pipeline={"schedule": "interleaved_1f1b", "stage3_gather_per_micro_batch": True}),
                    lambda: PipelineModule([LayerSpec(Block, D)] * 4 + [TiedLayerSpec("t", Block, D)]
                                           + [LayerSpec(Block, D)] * 3, num_stages=2, virtual_stages=2,
                                           partition_method="uniform")):
        try:
            attempt()
        except (StagesDoNotDivideError, TooFewLayersError, PipelineBatchSizeError, PipelineConfigError,
                TiedChunkError) as error:
            raised.append(type(error).__name__)
    own = PipelineModule(specs(), num_stages=2, loss_fn=loss_fn)  # its own mpu, as DeepSpeed scripts pass it
    zeroshard.initialize(model=own, mpu=own.mpu(), config=config(0, "1f1b", 2))[0].close()
    engine, _ = build(2, 0, "1f1b")
    for call in (lambda: engine(torch.zeros(1)), lambda: engine.backward(torch.zeros(())), engine.step):
        try:
            call()
        except PipelineUsageError as error:
            raised.append(type(error).__name__)
    engine.close()
    return raised


def check_refusals(by_rank: list[list[str]]) -> None:
    for raised in by_rank:
        assert raised == ["StagesDoNotDivideError", "TooFewLayersError", "PipelineBatchSizeError",
                          "PipelineConfigError"] + ["PipelineConfigError"] * 4 + ["TiedChunkError"] + \
            ["PipelineUsageError"] * 3, raised


class Head(nn.Module):
    """The tied output layer of the one-process model: it uses the embedding without holding it."""

    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        self.use = [embedding]

    def forward(self, x: torch.Tensor) -> Any:
        return logits(self.use[0], x)


class DropPositions(nn.Module):
    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return drop_positions(inputs)


def sequential() -> nn.Sequential:
    """The pipelined layers as one ``nn.Sequential``, whose keys a pipeline checkpoint is saved under."""
    embed = nn.Embedding(V, D)
    return nn.Sequential(embed, Positions(), Block(D), Block(D), Block(D), DropPositions(), nn.LayerNorm(D),
                         Head(embed))


#: where the checkpoint saved at pipeline 2 x data 2, ZeRO-1 is resumed: (pipeline depth, ZeRO stage); the
#: first is the saving run's own split, whose arithmetic is the uninterrupted run's (bitwise)
RESUMES = ((2, 1), (4, 3), (2, 2))


def resume_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    """Save after 3 steps, train 2 more; resume the saved checkpoint at each of ``RESUMES`` for those 2."""
    engine, _ = build(2, 1, "1f1b")
    reference = Reference()
    for step in range(3):
        engine.train_batch(data(step, rank % 2))
        reference.train_step(step, 2)
    engine.save_checkpoint(root, "step3")
    straight = [float(engine.train_batch(data(step, rank % 2))) for step in (3, 4)]
    engine.save_checkpoint(root, "straight")
    engine.close()
    resumed = {}
    for pp, stage in RESUMES:
        dp = 4 // pp
        engine, _ = build(pp, stage, "1f1b" if pp == 2 else "gpipe", gradient_accumulation_steps=ACCUM * 2 // dp,
                          train_batch_size=MICRO * ACCUM * 2)
        engine.load_checkpoint(root, "step3")
        # the same samples per step: data-parallel rank d of the saving run read data(step, d)
        batches = [lambda step: data(step, rank % 2)] if dp == 2 else [
            lambda step: iter([micro_batch(step, j, d) for j in range(ACCUM) for d in range(2)])]
        resumed[f"pp{pp}_z{stage}"] = [float(engine.train_batch(batches[0](step))) for step in (3, 4)]
        engine.save_checkpoint(root, f"pp{pp}_z{stage}")
        engine.close()
    saved = reference_state(reference)
    x, y = micro_batch(9, 0, 0)
    with torch.no_grad():
        reference_loss = float(loss_fn(reference.forward(x), y))
    return {"straight": straight, "resumed": resumed, "reference": saved,
            "reference_loss": reference_loss}


def check_resume(by_rank: list[dict[str, Any]], root: str) -> None:
    bitwise = f"pp{RESUMES[0][0]}_z{RESUMES[0][1]}"
    for rank, out in enumerate(by_rank):
        for name, losses in out["resumed"].items():
            bound = 0.0 if name == bitwise else 1e-6
            assert max(abs(a - b) for a, b in zip(losses, out["straight"])) <= bound, (rank, name, losses, out["straight"])
    straight = full_state_dict(root, "straight")
    for pp, stage in RESUMES:
        resumed = full_state_dict(root, f"pp{pp}_z{stage}")
        assert resumed.keys() == straight.keys()
        for key, value in straight.items():
            bound = 0.0 if f"pp{pp}_z{stage}" == bitwise else 1e-6
            assert float((resumed[key] - value).abs().max()) <= bound, (pp, stage, key)
    # the checkpoint is the state of one nn.Sequential of the layers, trained as the reference was
    model = sequential()
    model.load_state_dict(full_state_dict(root, "step3"), strict=True)
    out = by_rank[0]
    for key, value in model.state_dict().items():
        assert relative(value, out["reference"][key]) <= 1e-5, key
    x, y = micro_batch(9, 0, 0)
    with torch.no_grad():
        assert abs(float(loss_fn(model(x), y)) - out["reference_loss"]) <= 1e-5
    from safetensors.torch import load_file

    target = consolidate(root, Path(root) / "consolidated.safetensors", tag="step3")  # `zeroshard consolidate`
    model.load_state_dict(load_file(str(target)), strict=True)
    with torch.no_grad():
        assert abs(float(loss_fn(model(x), y)) - out["reference_loss"]) <= 1e-5


class Samples(torch.utils.data.Dataset):
    """Token sequences that remember which indices were read."""

    def __init__(self) -> None:
        self.data = torch.randint(0, V, (48, 6), generator=torch.Generator().manual_seed(7))
        self.read: list[int] = []

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.read.append(int(index))
        return self.data[index, :-1], self.data[index, 1:]


def loader_worker(rank: int, world: int) -> dict[str, Any]:
    """``initialize(training_data=...)``: ``train_batch()`` reads the loader, sampled over data-parallel ranks."""
    dataset = Samples()
    module = PipelineModule(specs(), num_stages=2, loss_fn=loss_fn, seed_layers=True)
    engine, _, _, _ = zeroshard.initialize(model=module, model_parameters=module.parameters(),
                                           config=config(1, "1f1b", 2), training_data=dataset)
    losses = [float(engine.train_batch()) for _ in range(2)]
    engine.close()
    reference, batch = Reference(), loader_batches(dataset)
    return {"losses": losses, "expected": [reference.train_step(step, 2, batch) for step in range(2)],
            "read": dataset.read}


def loader_batches(dataset: Samples) -> Any:
    """``batch(step, j, d)``: the micro-batch data-parallel rank ``d``'s loader hands out in the first epoch
    (the loader's seed is the config's, 0)."""
    orders = [list(torch.utils.data.DistributedSampler(dataset, num_replicas=2, rank=d, seed=0)) for d in range(2)]

    def batch(step: int, j: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = (step * ACCUM + j) * MICRO
        rows = dataset.data[orders[d][start: start + MICRO]]
        return rows[:, :-1], rows[:, 1:]

    return batch


def check_loader(by_rank: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(by_rank):
        for got, want in zip(out["losses"], out["expected"]):
            assert abs(got - want) <= 1e-5 * abs(want), (rank, out["losses"], out["expected"])
    # ranks 0, 1 are stage 0 of data-parallel ranks 0, 1; ranks 2, 3 stage 1 of the same
    assert by_rank[0]["read"] == by_rank[2]["read"] and by_rank[1]["read"] == by_rank[3]["read"]
    assert len(by_rank[0]["read"]) == 2 * ACCUM * MICRO and not set(by_rank[0]["read"]) & set(by_rank[1]["read"])


#: the bounds of tests/distributed/test_mixed_precision.py (its [Note: the stated tolerances]): each step's
#: loss within LOSS_TOL of fp32's, the weights' distance from fp32's within DEVIATION_TOL of how far
#: training moved them, at that test's learning rate
LOSS_TOL, DEVIATION_TOL, MIXED_LR = 2e-3, 0.06, 1e-3


def reference_state(reference: Reference) -> dict[str, torch.Tensor]:
    return {f"{i}.{name}": p.detach().clone() for i, m in reference.modules.items() for name, p in m.named_parameters()}


def bf16_worker(rank: int, world: int, root: str, pp: int, stage: int, chunks: int = 1) -> dict[str, Any]:
    """Train in bf16 (activations and gradients travel in bf16), save, and report the fp32 reference."""
    dp = 4 // pp
    accum = CHUNKED_ACCUM if chunks > 1 else ACCUM
    engine, module = build(pp, stage, "interleaved_1f1b" if chunks > 1 else "1f1b", SmallEmbedding, chunks=chunks,
                           bf16={"enabled": True}, gradient_accumulation_steps=accum,
                           train_batch_size=MICRO * accum * dp,
                           optimizer={"type": "AdamW", "params": {"lr": MIXED_LR, "weight_decay": WD}})
    reference = Reference(MIXED_LR, SmallEmbedding)
    initial = reference_state(reference)
    losses, expected = [], []
    for step in range(STEPS):
        losses.append(float(engine.train_batch(data(step, rank % dp, accum))))
        expected.append(reference.train_step(step, dp, accum=accum))
    copy = module.tied.ties[0].copy
    copy_dtype = str(copy.dtype) if copy is not None else None
    engine.save_checkpoint(root, "bf16")  # the fp32 masters
    engine.close()
    return {"losses": losses, "expected": expected, "copy_dtype": copy_dtype, "initial": initial,
            "reference": reference_state(reference)}


def check_bf16(by_rank: list[dict[str, Any]], root: str, pp: int, stage: int, chunks: int = 1) -> None:
    for rank, out in enumerate(by_rank):
        assert max(abs(a - b) for a, b in zip(out["losses"], out["expected"])) <= LOSS_TOL, (rank, out["losses"])
        if rank // (4 // pp) == pp - 1:  # the last stage holds a copy of the tied embedding, in bf16
            assert out["copy_dtype"] == "torch.bfloat16", out["copy_dtype"]
    masters, out = full_state_dict(root, "bf16"), by_rank[0]
    distance = sum(float((masters[k] - out["reference"][k]).square().sum()) for k in masters) ** 0.5
    moved = sum(float((out["reference"][k] - out["initial"][k]).square().sum()) for k in masters) ** 0.5
    assert distance <= DEVIATION_TOL * moved, (distance, moved)


#: fp16 against zeroshard's own engine in one process with the same fp16 config (see ``fp16_worker``): the
#: same loss scale after every step on every rank, each step's loss within FP16_LOSS_TOL, each parameter
#: (16-bit values) within FP16_PARAM_TOL relative.  The two differ by fp16 rounding alone: the
#: data-parallel average instead of one process's accumulation, and a tied weight's copy summed apart
#: from its owner; measured: losses at most 4.8e-6 apart, parameters 3.6e-4 (about a third of fp16's
#: 2^-10 spacing); the bounds are about four and three times that.  A second application of the loss
#: scale fails them (losses 1.4e-3 apart, parameters 3e-2, and the scales differ).  The config starts at a
#: scale of 2^8 and doubles it every 2 clean steps, so a few steps change it
FP16_LOSS_TOL, FP16_PARAM_TOL = 2e-5, 1e-3
FP16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}


def lone_engine(model: nn.Module, cfg: dict[str, Any]) -> Any:
    """zeroshard's own engine over ``model`` in this process alone (a world of one inside the job)."""
    from zeroshard.config import load_config, resolve_batch_sizes
    from zeroshard.distributed.world import World
    from zeroshard.engine.engine import Engine

    return Engine(model, resolve_batch_sizes(load_config(cfg), 1), World(0, 1, 0, torch.device("cpu"), "none"))


def reference_sequential(reference: Reference) -> nn.Sequential:
    """The reference's layers (the pipeline's initial weights) as one ``nn.Sequential``."""
    m = reference.modules
    return nn.Sequential(m[0], Positions(), m[2], m[3], m[4], DropPositions(), m[6], Head(m[0]))


def fp16_worker(rank: int, world: int, pp: int, stage: int) -> dict[str, Any]:
    """fp16 pipeline steps, and the same layers trained by one process's engine with the same fp16 config,
    the data-parallel ranks' micro-batches accumulated."""
    optimizer = {"type": "AdamW", "params": {"lr": MIXED_LR, "weight_decay": WD}}
    engine, module = build(pp, stage, "1f1b", SmallEmbedding, fp16=FP16, optimizer=optimizer)
    dp = 4 // pp
    reference = Reference(MIXED_LR, SmallEmbedding)
    lone = lone_engine(reference_sequential(reference),
                       {**config(0, "1f1b", 1, fp16=FP16, optimizer=optimizer), "pipeline": {},
                        "gradient_accumulation_steps": ACCUM * dp, "train_batch_size": MICRO * ACCUM * dp})
    losses, expected, scales, expected_scales = [], [], [], []
    for step in range(STEPS):
        losses.append(float(engine.train_batch(data(step, rank % dp))))
        scales.append(engine.loss_scaler.scale)
        total = 0.0
        for j in range(ACCUM):
            for d in range(dp):
                x, y = micro_batch(step, j, d)
                loss = loss_fn(lone(x), y)
                lone.backward(loss)
                lone.step()
                total += float(loss) / (ACCUM * dp)
        expected.append(total)
        expected_scales.append(lone.loss_scaler.scale)
    skipped = (engine.skipped_steps, lone.skipped_steps)
    lone.close()  # hands the reference's layers back with the weights it trained
    errors = stage_param_errors(module, reference)
    engine.close()
    return {"losses": losses, "expected": expected, "scales": scales, "expected_scales": expected_scales,
            "skipped": skipped, "errors": errors}


def check_fp16(by_rank: list[dict[str, Any]], pp: int, stage: int) -> None:
    for rank, out in enumerate(by_rank):
        assert out["scales"] == out["expected_scales"], (rank, out["scales"], out["expected_scales"])
        assert out["skipped"][0] == out["skipped"][1], (rank, out["skipped"])
        assert max(abs(a - b) for a, b in zip(out["losses"], out["expected"])) <= FP16_LOSS_TOL, (rank, out)
        assert out["errors"] and max(out["errors"]) <= FP16_PARAM_TOL, (rank, out["errors"])
    assert len({tuple(out["scales"]) for out in by_rank}) == 1


#: the step whose gradients overflow on one rank of the last stage, in ``overflow_worker``
OVERFLOW_STEP = 2


def stage_values(engine: Any, module: PipelineModule) -> list[torch.Tensor]:
    """The stage's full parameters, its fp32 masters (mixed precision: this rank's shard) and its copy of
    the tied embedding: everything a skipped step leaves untouched on this rank."""
    with zeroshard.GatheredParameters(list(module.parameters())):  # read inside: stage 3's placeholders
        values = [p.detach().clone() for p in module.parameters()]
    if engine.strategy.masters is not None:
        values.append(engine.strategy.masters.data.clone())
    copy = module.tied.ties[0].copy
    return values + ([copy.detach().clone()] if copy is not None else [])


def overflow_worker(rank: int, world: int, stage: int) -> dict[str, Any]:
    """fp16 with an inf in one gradient of the last stage's data-parallel rank 0 at ``OVERFLOW_STEP``
    only: every rank of both stages must skip that step, and only that one."""
    engine, module = build(2, stage, "1f1b", SmallEmbedding, fp16=FP16,
                           optimizer={"type": "AdamW", "params": {"lr": MIXED_LR, "weight_decay": WD}})
    at = {"step": -1}
    if rank == 2:  # pipeline stage 1, data-parallel rank 0
        next(iter(module.parameters())).register_hook(
            lambda grad: grad * float("inf") if at["step"] == OVERFLOW_STEP else grad)
    scales, untouched, losses = [], None, []
    for step in range(4):
        at["step"] = step
        before = stage_values(engine, module) if step == OVERFLOW_STEP else None
        losses.append(float(engine.train_batch(data(step, rank % 2))))
        scales.append(engine.loss_scaler.scale)
        if before is not None:
            untouched = all(torch.equal(a, b) for a, b in zip(before, stage_values(engine, module)))
    result = {"scales": scales, "skipped": engine.skipped_steps, "untouched": untouched, "losses": losses,
              "overflow": engine.optimizer.overflow}
    engine.close()
    return result


def check_overflow(by_rank: list[dict[str, Any]], stage: int) -> None:
    for rank, out in enumerate(by_rank):
        assert out["skipped"] == 1 and out["untouched"], (rank, out)
        assert out["scales"] == by_rank[0]["scales"], (rank, out["scales"], by_rank[0]["scales"])
        assert out["losses"] == by_rank[0]["losses"] and all(abs(x) < 10 for x in out["losses"]), (rank, out)
    scales = by_rank[0]["scales"]  # halved at the overflow (hysteresis 1), doubled every 2 clean steps
    assert scales[OVERFLOW_STEP] == scales[OVERFLOW_STEP - 1] / 2, scales


def periodic_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    """``checkpoint.save_interval`` 2 and ``keep_last`` 1 over 5 steps; a fresh engine resumes the last
    periodic save (``latest``) for the fifth step."""
    periodic = {"save_dir": root, "save_interval": 2, "keep_last": 1}
    engine, module = build(2, 1, "1f1b", checkpoint=periodic)
    straight, listings = [], []
    for step in range(5):
        straight.append(float(engine.train_batch(data(step, rank % 2))))
        listings.append(sorted(p.name for p in Path(root).iterdir()) if rank == 0 and Path(root).is_dir() else [])
    final = stage_values(engine, module)
    engine.close()
    engine, module = build(2, 1, "1f1b", checkpoint=periodic)
    path, _ = engine.load_checkpoint(root)
    resumed = float(engine.train_batch(data(4, rank % 2)))
    same = all(torch.equal(a, b) for a, b in zip(final, stage_values(engine, module)))
    result = {"straight": straight, "resumed": resumed, "same": same, "listings": listings,
              "loaded": Path(str(path)).name, "steps": engine.global_steps}
    engine.close()
    return result


def check_periodic(by_rank: list[dict[str, Any]], root: str) -> None:
    for rank, out in enumerate(by_rank):
        assert out["loaded"] == "global_step4" and out["steps"] == 5, (rank, out)
        assert out["resumed"] == out["straight"][4] and out["same"], (rank, out)  # bitwise
    # each rank 0 listing after steps 1-5: every stage in one checkpoint per save, the older pruned
    assert by_rank[0]["listings"] == [[], ["global_step2", "latest"], ["global_step2", "latest"],
                                      ["global_step4", "latest"], ["global_step4", "latest"]], by_rank[0]["listings"]
    assert (Path(root) / "latest").read_text().strip() == "global_step4"
    saved = full_state_dict(root, "global_step4")
    assert saved.keys() == sequential().state_dict().keys()  # the layers of both stages


#: ``initialize_resume_worker``: 5 steps with the engine's loader; the loader's epoch (24 samples per
#: data-parallel rank, 6 per step) ends with step 4, so the resumed step 5 starts the next epoch
INIT_STEPS = 5


def start_with_loader(dataset: Samples, scramble: bool, resume_from: Any = None,
                      **more: Any) -> tuple[Any, PipelineModule]:
    """A pipeline 2 x data 2, ZeRO-1 engine from ``initialize(training_data=dataset, resume_from=...)`` with
    the config keys ``more``; ``scramble``: torch's generator is moved elsewhere first (only a restored RNG
    state gives it back)."""
    module = PipelineModule(specs(), num_stages=2, loss_fn=loss_fn, seed_layers=True)
    if scramble:
        torch.manual_seed(4321)
    engine, _, _, _ = zeroshard.initialize(model=module, model_parameters=module.parameters(),
                                           config=config(1, "1f1b", 2, **more), training_data=dataset,
                                           resume_from=resume_from)
    return engine, module


def initialize_resume_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    """``checkpoint.auto_resume`` over an empty ``save_dir`` starts fresh and saves every 2 steps; then a new
    engine from ``initialize(resume_from=root)`` and another from ``auto_resume`` carry on at step 4
    (the ``latest``): counters, RNG, loader position, and step 5 as the uninterrupted run's."""
    periodic = {"save_dir": root, "save_interval": 2}
    dataset = Samples()
    engine, module = start_with_loader(dataset, False, checkpoint={**periodic, "auto_resume": True})
    fresh = engine.counters.state_dict()
    straight, reads = [], []
    for step in range(INIT_STEPS):
        if step == INIT_STEPS - 1:
            counters, rng = engine.counters.state_dict(), torch.get_rng_state()
        before = len(dataset.read)
        straight.append(float(engine.train_batch()))
        reads.append(dataset.read[before:])
    final = stage_values(engine, module)
    listing = sorted(p.name for p in Path(root).iterdir())
    engine.close()
    reference, batch = Reference(), loader_batches(dataset)
    out: dict[str, Any] = {"fresh": fresh, "straight": straight, "counters": counters, "listing": listing,
                           "read": reads[-1],
                           "expected": [reference.train_step(step, 2, batch) for step in range(INIT_STEPS - 1)]}
    for how, more in (("resume_from", {"resume_from": root}),
                      ("auto_resume", {"checkpoint": {**periodic, "auto_resume": True}})):
        dataset = Samples()
        engine, module = start_with_loader(dataset, True, **more)
        at = engine.counters.state_dict()
        same_rng = torch.equal(torch.get_rng_state(), rng)
        loss = float(engine.train_batch())
        same = all(torch.equal(a, b) for a, b in zip(final, stage_values(engine, module)))
        out[how] = {"counters": at, "rng": same_rng, "loss": loss, "same": same, "read": dataset.read}
        engine.close()
    return out


def check_initialize_resume(by_rank: list[dict[str, Any]], root: str) -> None:
    for rank, out in enumerate(by_rank):
        assert out["fresh"] == {"global_steps": 0, "micro_steps": 0, "global_samples": 0, "skipped_steps": 0}, out
        for got, want in zip(out["straight"], out["expected"]):  # a fresh start: the seeded layers' training
            assert abs(got - want) <= 1e-5 * abs(want), (rank, out["straight"], out["expected"])
        assert out["counters"]["global_steps"] == INIT_STEPS - 1, out["counters"]
        assert out["listing"] == ["global_step2", "global_step4", "latest"], out["listing"]
        for how in ("resume_from", "auto_resume"):
            resumed = out[how]
            assert resumed["counters"] == out["counters"], (rank, how, resumed, out["counters"])
            assert resumed["rng"], (rank, how)
            assert resumed["read"] == out["read"], (rank, how, resumed["read"], out["read"])  # the next epoch's
            assert resumed["loss"] == out["straight"][-1] and resumed["same"], (rank, how, resumed, out)  # bitwise
    assert by_rank[0]["read"] == by_rank[2]["read"] and by_rank[0]["read"] != by_rank[1]["read"]
    assert (Path(root) / "latest").read_text().strip() == "global_step4"


WORKERS = {"train": train_worker, "refusals": refusals_worker, "resume": resume_worker, "bf16": bf16_worker,
           "loader": loader_worker, "fp16": fp16_worker, "overflow": overflow_worker, "periodic": periodic_worker,
           "initialize_resume": initialize_resume_worker, "gathers": gathers_worker, "zeropp": zeropp_worker}
CHECKS = {"train": check_train, "refusals": check_refusals, "resume": check_resume, "bf16": check_bf16,
          "loader": check_loader, "fp16": check_fp16, "overflow": check_overflow, "periodic": check_periodic,
          "initialize_resume": check_initialize_resume, "gathers": check_gathers, "zeropp": check_zeropp}


def test_pipeline_matches_one_process(tmp_path: Path) -> None:
    cases: list[tuple[str, dict[str, Any]]] = [
        ("train", {"pp": 2, "stage": stage, "schedule": schedule})
        for stage in (0, 1, 2, 3) for schedule in ("1f1b", "gpipe")]
    cases += [("train", {"pp": 4, "stage": 1, "schedule": "1f1b"}), ("train", {"pp": 4, "stage": 3, "schedule": "gpipe"}),
              ("resume", {"root": str(tmp_path / "resume")}),
              ("bf16", {"root": str(tmp_path / "bf16"), "pp": 2, "stage": 2}), ("loader", {}), ("refusals", {})]
    # the interleaved schedule: two chunks per stage at pipeline 2 x data 2 (ZeRO 0-3) and 4 x 1, three at 2 x 2
    cases += [("train", {"pp": 2, "stage": stage, "schedule": "interleaved_1f1b", "chunks": 2}) for stage in (0, 1, 2, 3)]
    cases += [("train", {"pp": 4, "stage": 1, "schedule": "interleaved_1f1b", "chunks": 2}),
              ("train", {"pp": 4, "stage": 3, "schedule": "interleaved_1f1b", "chunks": 2}),
              ("train", {"pp": 2, "stage": 2, "schedule": "interleaved_1f1b", "chunks": 3}),
              ("gathers", {"schedule": "interleaved_1f1b", "per_micro_batch": False, "chunks": 2}),
              ("bf16", {"root": str(tmp_path / "bf16_chunks"), "pp": 2, "stage": 3, "chunks": 2})]
    # fp16 at pipeline 2 x data 2 (ZeRO 0-2) and 4 x 1 (ZeRO 3), an overflow on one rank, CPU offload
    cases += [("fp16", {"pp": 2, "stage": stage}) for stage in (0, 1, 2)]
    cases += [("fp16", {"pp": 4, "stage": 3}), ("overflow", {"stage": 3}), ("overflow", {"stage": 0}),
              ("train", {"pp": 2, "stage": 2, "schedule": "1f1b", "offload": "optimizer"}),
              ("train", {"pp": 4, "stage": 1, "schedule": "gpipe", "offload": "optimizer"}),
              ("train", {"pp": 2, "stage": 3, "schedule": "gpipe", "offload": "param"}),
              ("periodic", {"root": str(tmp_path / "periodic")}),
              # ZeRO-3 with every parameter sharded: a stage's units gathered once per batch, or per micro-batch
              *[("gathers", {"schedule": schedule, "per_micro_batch": per_micro_batch})
                for schedule in ("1f1b", "gpipe") for per_micro_batch in (False, True)],
              ("initialize_resume", {"root": str(tmp_path / "initialize_resume")}),
              ("zeropp", {"stage": 3})]
    check_family(cases, run_family(4, cases, WORKERS), CHECKS, world=4)
