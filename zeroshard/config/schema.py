"""The typed configuration: one frozen dataclass per JSON block, one documented field per key.

The DeepSpeed JSON keys are the public surface; these classes are what the rest of zeroshard reads.
Each field carries a ``doc`` and, where a value has limits, a ``check`` in its metadata; the loader
(:mod:`zeroshard.config.loader`) walks these classes generically, so adding a key is adding a field.
The docs are the "meaning" column of docs/CONFIGURATION.md's key table, which
``python -m zeroshard.config.reference`` renders from these classes (in field order), so they are
written in Markdown for a reader of that page; ``default_text`` says how the table shows a default
that the plain value would misrepresent (a derived batch size, a dtype that follows the training one).

[Note: defaults]
Defaults are DeepSpeed's, as the release zeroshard reports computes them from a config that leaves the
key out; the few that differ on purpose are listed with their reasons in kept_defaults.py ([Note:
defaults that differ from DeepSpeed's] in zeroshard/config/kept_defaults.py).  The one that changes how
the engine runs: ``zero_optimization.overlap_comm`` defaults to true at every stage.  DeepSpeed turns it on only at
stage 3, but in zeroshard overlapping costs no extra memory at stages 0-1 and only the buckets in
flight at stage 2, and without it the engine could not keep up with ``DistributedDataParallel``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, is_dataclass
from typing import Any, Literal, Optional

from .fields import key, non_negative, optional_positive, positive, strings
from .checkpoint_block import CheckpointConfig, CheckpointWriterConfig
from .fp8_block import FP8Config

#: the optimizers zeroshard builds from the config (DeepSpeed's names, matched in any case)
OPTIMIZER_TYPES = ("Adam", "AdamW", "SGD", "Muon")


@dataclass(frozen=True)
class OptimizerConfig:
    """``optimizer``: which torch optimizer zeroshard builds over each rank's shard."""

    type: Literal["Adam", "AdamW", "SGD", "Muon"] = key(
        "AdamW", "`Adam`, `AdamW`, `SGD` or `Muon` (DeepSpeed's `Adam` is decoupled, as AdamW, unless `adam_w_mode` "
        "is false; `Muon` steps the hidden matrices by Muon, each whole on one rank, and the rest by AdamW).")
    params: dict = key(
        {}, "Keyword arguments of the optimizer, checked per type. Adam/AdamW: `lr`, `betas`, `eps`, "
        "`weight_decay`, `amsgrad` (`adam_w_mode` for Adam; `torch_adam` picks the class as DeepSpeed does: true "
        "torch's `Adam`/`AdamW`, false `FusedAdam`, or `DeepSpeedCPUAdam` under optimizer offload; every one "
        "steps torch's fused kernel); SGD: `lr`, `momentum`, `dampening`, `weight_decay`, "
        "`nesterov`; Muon (DeepSpeed's keys): `lr`, `muon_lr`, `adam_lr`, `momentum`, `weight_decay`, `betas`, "
        "`eps`, `ns_method` (`gram` or `standard`), `torch_adam` (accepted; the rest is stepped by "
        "torch's AdamW either way).", default_text="torch's")


@dataclass(frozen=True)
class SchedulerConfig:
    """``scheduler``: a DeepSpeed learning-rate schedule, stepped once per optimizer step."""

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"] = key(
        "WarmupLR", "`WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR`, `OneCycle` or `LRRangeTest`; every optimizer "
        "step uses the same lr as under DeepSpeed (the schedule starts at iteration -1 and is stepped after each "
        "optimizer step, never on a skipped one).")
    params: dict = key(
        {}, "Parameters of the schedule, checked per type: `warmup_min_lr`, `warmup_max_lr` (default: the "
        "optimizer's lr for WarmupLR), `warmup_num_steps`, `warmup_type` (`log`/`linear`), `total_num_steps`; "
        "cosine: `warmup_min_ratio`, `cos_min_ratio`; OneCycle: `cycle_min_lr`, `cycle_max_lr`, `decay_lr_rate`, "
        "`cycle_first_step_size`, `cycle_second_step_size`, `cycle_first_stair_count`, `cycle_second_stair_count`, "
        "`decay_step_size`, `cycle_momentum`, `cycle_min_mom`, `cycle_max_mom`, `decay_mom_rate`; LRRangeTest: "
        "`lr_range_test_min_lr`, `lr_range_test_step_size`, `lr_range_test_step_rate`, `lr_range_test_staircase`.",
        default_text="DeepSpeed's")


@dataclass(frozen=True)
class BF16Config:
    """``bf16``: compute in bfloat16; fp32 master weights and optimizer state (see zeroshard/precision)."""

    enabled: bool = key(False, "Train in bfloat16 with fp32 master weights and fp32 optimizer state.")


@dataclass(frozen=True)
class FP16Config:
    """``fp16``: compute in float16 with loss scaling; fp32 master weights and optimizer state.

    [Note: one set of loss-scaling defaults]
    Dynamic scaling starts at 2**initial_scale_power, 2**16 by default, whatever else the block names,
    as in the DeepSpeed release zeroshard reports; older DeepSpeed releases started at 2**32 when the
    block named none of the dynamic-scaling keys.
    """

    enabled: bool = key(False, "Train in float16 with dynamic (or static) loss scaling and fp32 master weights "
                               "(not together with `bf16`).")
    loss_scale: float = key(0.0, "0: dynamic loss scaling; a value > 0: that static scale.", non_negative)
    initial_scale_power: int = key(16, "Dynamic scaling starts at 2^this.",
                                   lambda v: None if 0 <= v <= 64 else "an integer from 0 to 64")
    loss_scale_window: int = key(1000, "Double the scale after this many consecutive steps without overflow.",
                                 positive)
    hysteresis: int = key(2, "Overflows absorbed before the scale halves (refilled when it grows).", positive)
    consecutive_hysteresis: bool = key(False, "Refill the hysteresis after every step without overflow.")
    min_loss_scale: float = key(1.0, "Lowest dynamic scale; an overflow at this scale stops training with "
                                     "`LossScaleError`.", positive)


@dataclass(frozen=True)
class DataTypesConfig:
    """``data_types``: the dtype gradients accumulate in."""

    grad_accum_dtype: Optional[Literal["fp32", "fp16", "bf16"]] = key(
        None, "dtype gradients are held and accumulate in: `fp32` or the training dtype.",
        default_text="training dtype; `fp32` under bf16 with `gradient_accumulation_steps` > 1 or an fp32 "
                     "`communication_data_type`")


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """``activation_checkpointing``: how ``zeroshard.deepspeed.checkpointing.checkpoint`` stores and recomputes.

    The keys that only make sense with tensor parallelism (partitioning the saved activations across
    model-parallel ranks, and the contiguous buffer that partitioning fills) are refused: zeroshard
    has no tensor parallelism, so accepting them would change nothing.
    """

    partition_activations: bool = key(
        False, "Only `false`: partitioning the saved activations across model-parallel ranks needs tensor "
        "parallelism, which zeroshard does not have.",
        lambda v: None if v is False else "false (partitioning activations across model-parallel ranks needs "
                                          "tensor parallelism, which zeroshard does not have)")
    cpu_checkpointing: bool = key(
        False, "Keep each checkpointed region's saved inputs in host memory until recomputation.")
    contiguous_memory_optimization: bool = key(
        False, "Only `false`: it packs partitioned activations, which need tensor parallelism (see "
        "`partition_activations`).",
        lambda v: None if v is False else "false (it packs partitioned activations, and partition_activations "
                                          "is not supported)")
    number_checkpoints: Optional[int] = key(
        None, "Refused when set: it only sizes `contiguous_memory_optimization`'s buffer, which needs tensor "
        "parallelism.",
        lambda v: None if v is None else "omitted (it only sizes contiguous_memory_optimization's buffer)")
    synchronize_checkpoint_boundary: bool = key(
        False, "Synchronize the (CUDA) device at both ends of each checkpointed region (CPU work is synchronous).")
    profile: bool = key(
        False, "Count and time checkpointed forwards and recomputations; the totals are in the metrics "
        "(`engine.last_metrics`).")


@dataclass(frozen=True)
class PipelineConfig:
    """``pipeline``: pipeline parallelism, for a model given as a ``PipelineModule`` (docs/PIPELINE.md).

    The module is built before ``initialize()``, so its own arguments decide the split; a key set here
    must agree with them (a disagreement is refused, naming both values).
    """

    stages: Optional[int] = key(
        None, "Pipeline stages; when set, must equal the `PipelineModule`'s `num_stages` (omitted: the module's).",
        optional_positive, default_text="the module's")
    partition: Optional[str] = key(
        None, "How layers are split between stages (`parameters`, `uniform` or `type:<regex>`); when set, must "
        "equal the module's `partition_method`.", default_text="the module's")
    seed_layers: Optional[bool] = key(
        None, "Seed each layer's construction by its index; when set, must equal the module's `seed_layers`.",
        default_text="the module's")
    activation_checkpoint_interval: Optional[int] = key(
        None, "Layers per checkpointed run (0: none); when set, must equal the module's.",
        lambda v: None if v is None or v >= 0 else "a number >= 0", default_text="the module's")
    schedule: Literal["1f1b", "gpipe", "interleaved_1f1b"] = key(
        "1f1b", "zeroshard's own key: `1f1b` (one forward, one backward: a stage holds at most as many "
        "micro-batches' activations as there are stages after it) or `gpipe` (every forward, then every "
        "backward: a stage holds all of them); both idle (stages - 1) / (micro-batches + stages - 1) of a batch. "
        "`interleaved_1f1b`: 1F1B over the chunks of a `PipelineModule(virtual_stages=v)`, v >= 2, with "
        "micro-batches a multiple of the stages; idles (stages - 1) / (v x micro-batches + stages - 1), for v "
        "times the point-to-point messages.")
    virtual_stages: Optional[int] = key(
        None, "Chunks of layers per stage (the interleaved schedule); when set, must equal the module's "
        "`virtual_stages`.", optional_positive, default_text="the module's")
    stage3_gather_per_micro_batch: bool = key(
        False, "zeroshard's own key, ZeRO stage 3: `false` gathers a stage's parameters once per batch and keeps "
        "them through every micro-batch's forward and backward, released before the step (each rank of the stage "
        "holds the stage's full parameters for the whole batch, beside its shard); `true` gathers them for each "
        "micro-batch's forward and again for its backward and releases them after each (2 x micro-batches "
        "all-gathers of each unit per batch instead of 1), for when memory is shorter than bandwidth.")


@dataclass(frozen=True)
class SequenceParallelConfig:
    """``sequence_parallel``: how ``DistributedAttention`` computes attention over sequences split across
    the ``sequence_parallel_size`` ranks (docs/SEQUENCE_PARALLEL.md)."""

    mode: Literal["ulysses", "ring"] = key(
        "ulysses", "`ulysses`: two all-to-alls trade the sequence split for a head split around the model's own "
        "local attention (the query heads must divide by `sequence_parallel_size`); `ring`: the keys and values "
        "travel round the sequence group, each rank's queries meeting every block, with the blocks' softmaxes "
        "merged exactly: any head count at any degree, no local attention called (the ring computes "
        "`softmax(q k^T / sqrt(head_dim)) v` itself, masked by `causal`). The Hugging Face path "
        "(`UlyssesSPAttentionHF`) follows it too.")
    causal: bool = key(
        True, "With `mode` `ring`: each position attends only to itself and the positions before it (false: to "
        "every position). With `ulysses` the local attention decides the mask, and `false` is refused.")
    load_balance: bool = key(
        False, "With `mode` `ring` (and `causal`): head-tail sharding, each rank's causal work equal. The sequence "
        "is cut into 2 x `sequence_parallel_size` chunks and rank r holds chunks r and 2P - 1 - r, in that order: "
        "the data must be cut the same way (`zeroshard.sequence.sequence_positions`; `UlyssesSPDataLoaderAdapter` "
        "cuts so). False: rank r holds the "
        "r-th consecutive slice. Refused with `ulysses`.")


@dataclass(frozen=True)
class CompileConfig:
    """``compile``: DeepSpeed's DeepCompile block; compile with ``engine.compile()`` (docs/USAGE.md)."""

    deepcompile: bool = key(
        False, "DeepSpeed's DeepCompile (its own graph passes for ZeRO): zeroshard has none, so `true` is refused; "
        "`engine.compile()` or `torch.compile` compiles the model and zeroshard keeps its hooks outside the graphs.")


@dataclass(frozen=True)
class TensorParallelConfig:
    """``tensor_parallel``: DeepSpeed's AutoTP training, the model's linear layers split over groups of
    ``autotp_size`` neighbouring ranks with torch's DTensor (docs/TENSOR_PARALLEL.md)."""

    autotp_size: int = key(
        0, "Ranks each linear layer of the plan is split over (0 or 1: off); divides the world, and the attention "
        "heads and key/value heads of a Hugging Face model.", non_negative)
    partition_config: Optional[dict] = key(
        None, "DeepSpeed's custom plan: `{\"use_default_specs\": bool, \"layer_specs\": [{\"patterns\": [regex of a "
        "weight's name], \"partition_type\": \"column\" or \"row\"}]}`; its specs come first, then (with "
        "`use_default_specs`, default true) the default plan. A pattern that matches no linear weight is an error.")
    preset_model: Optional[str] = key(
        None, "A named default plan: `llama`, `mistral`, `qwen2` (attention q/k/v column, o row; MLP gate/up column, "
        "down row); omitted: the model's own `base_model_tp_plan` (Hugging Face), else that same decoder plan.",
        default_text="the model's plan")
    tp_overlap_comm: bool = key(
        False, "DeepSpeed's overlap of the tensor-parallel all-reduce with compute: not available (true is refused).")


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    """``zero_optimization.offload_optimizer``: where the fp32 masters and optimizer state live (stages 1-3)."""

    device: Literal["none", "cpu", "nvme"] = key(
        "none", "Stages 1-3: `cpu` (host memory) or `nvme` (files under `nvme_path`, ZeRO-Infinity) keeps the fp32 "
        "masters and optimizer state off the device; `none`: with the parameters.")
    nvme_path: Optional[str] = key(
        "/local_nvme", "Directory of the optimizer's swap files when `device` is `nvme` (null: unset, as Hugging "
        "Face writes it).")
    pin_memory: bool = key(
        False, "Page-locked host buffers, for faster device copies (CUDA; no effect on a CPU device).")
    buffer_count: int = key(
        4, "`nvme`: sub-groups held in host memory at once (>= 2: one updated while the next are read).",
        lambda v: None if v >= 2 else "an integer >= 2")

    @property
    def nvme_directory(self) -> str:
        """``nvme_path``, which the loader requires whenever ``device`` is nvme."""
        if self.nvme_path is None:
            raise ValueError("nvme_path is not set (the config loader requires it with device nvme)")
        return self.nvme_path


@dataclass(frozen=True)
class OffloadParamConfig:
    """``zero_optimization.offload_param``: where stage 3 keeps this rank's parameter shards."""

    device: Literal["none", "cpu", "nvme"] = key(
        "none", "Stage 3: `cpu` (host memory) or `nvme` (files under `nvme_path`, with `offload_optimizer`) keeps "
        "this rank's parameter shards off the device. `cpu` without `offload_optimizer` (ZeRO-Inference, also "
        "with an optimizer): fp32 masters and optimizer state on the device, updates written into the shards.")
    nvme_path: Optional[str] = key(
        "/local_nvme", "Directory of the parameter swap files when `device` is `nvme` (null: unset, as Hugging "
        "Face writes it).")
    pin_memory: bool = key(False, "Page-locked host shards (CUDA; no effect on a CPU device).")
    buffer_count: int = key(
        5, "`nvme`: staging buffers for shard reads and writes (the writes in flight), each of `buffer_size` "
        "elements.", positive)
    buffer_size: int = key(
        100_000_000, "`nvme`: elements of one staging buffer (see `buffer_count`); each bucket's shard must fit "
        "one.", positive)
    max_in_cpu: int = key(
        1_000_000_000, "`nvme`: elements of shards kept in host memory (the first buckets); the rest live on NVMe "
        "(0: all of them).", non_negative)

    @property
    def nvme_directory(self) -> str:
        """``nvme_path``, which the loader requires whenever ``device`` is nvme."""
        if self.nvme_path is None:
            raise ValueError("nvme_path is not set (the config loader requires it with device nvme)")
        return self.nvme_path


#: DeepSpeed's default leaf classes: Hugging Face mixture-of-experts blocks, whose forward runs the
#: experts the router picks (see [Note: leaf modules] in sharding/stage3/units.py)
DEFAULT_LEAF_MODULE_CLASSES: list[str] = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]


@dataclass(frozen=True)
class LeafModuleConfig:
    """``zero_optimization.leaf_module``: the modules ``initialize()`` marks as leaves, as
    ``set_z3_leaf_modules`` would (see [Note: leaf modules] in sharding/stage3/units.py); a lone string
    is read as a list of one, as DeepSpeed reads it."""

    classes: list = key(
        DEFAULT_LEAF_MODULE_CLASSES, "Module classes to mark, by class name or fully qualified name (subclasses "
        "not included).", strings, default_text="Mixtral's, Qwen2-MoE's and Qwen3-MoE's sparse MoE blocks")
    names: list = key([], "Modules to mark, by their name in `named_modules()`.", strings)
    name_suffixes: list = key([], "Modules to mark whose `named_modules()` name ends with one of these.", strings)


@dataclass(frozen=True)
class ZeroConfig:
    """``zero_optimization``: which training state is sharded and how gradients are communicated."""

    stage: int = key(0, "0: data parallel; 1: shard optimizer state; 2: also gradients; 3: also parameters.",
                     lambda v: None if v in (0, 1, 2, 3) else "0, 1, 2 or 3")
    reduce_bucket_size: int = key(
        500_000_000, "Elements per gradient bucket (one collective each). At stages 0-1 a bucket holds at most 1/8 "
        "of the trainable elements, at stage 2 1/16 (never capped below 4M elements), so DeepSpeed's default never "
        "means one model-size buffer.", positive)
    allgather_bucket_size: int = key(500_000_000, "Elements of parameter all-gathers in flight after the step (stages 1-2).",
                                     positive)
    overlap_comm: bool = key(
        True, "Launch each gradient bucket's collective as soon as it is full (false: blocking).")
    overlap_param_gather: bool = key(
        False, "zeroshard's own key, stages 1-2: the all-gather of the updated parameters after `step()` runs on "
        "into the next forward, each module waiting only for its own bucket; `state_dict()`, checkpoints, "
        "`GatheredParameters`, `full_state_dict()` and the next backward wait for all of it. Parameter tensors read "
        "directly between `step()` and the next forward (an EMA, a comparison after the loop) may then be stale, "
        "which is why it is off by default: `step()` then returns with every parameter current, as DeepSpeed's "
        "does.")
    ignore_unused_parameters: bool = key(
        True, "A trainable parameter that gets no gradient in a backward counts as a zero gradient (true); false: "
        "every rank raises `UnusedParameterError` (an `AssertionError`) naming it, after one small all-reduce of a "
        "flag per backward that keeps the ranks together.")
    contiguous_gradients: bool = key(
        True, "Always on: gradients are copied into contiguous buckets (only `true` is accepted).",
        lambda v: None if v is True else "true (zeroshard always copies gradients into contiguous buckets)",
    )
    reduce_scatter: bool = key(
        True, "Stages 1-3: reduce-scatter gradients (true), or all-reduce them and keep the own shard (false)."
    )
    stage3_prefetch_bucket_size: int = key(
        50_000_000, "Stage 3: elements of upcoming units gathered ahead of use (order recorded on the first pass); "
        "the next unit is prefetched whatever its size, this bounds the ones after it; 0 turns prefetch off.",
        non_negative)
    stage3_param_persistence_threshold: int = key(
        100_000, "Stage 3: parameters with at most this many elements stay whole on every rank.", non_negative)
    stage3_max_live_parameters: int = key(
        1_000_000_000, "Stage 3: gathered elements allowed at once before prefetching and keeping stop.", positive)
    stage3_max_reuse_distance: int = key(
        1_000_000_000, "Stage 3: keep a unit gathered if the recorded order uses it again within this many "
        "elements.", non_negative)
    offload_optimizer: OffloadOptimizerConfig = key(OffloadOptimizerConfig(), "Optimizer offload (stages 1-3).")
    offload_param: OffloadParamConfig = key(OffloadParamConfig(), "Parameter offload (stage 3).")
    leaf_module: LeafModuleConfig = key(
        LeafModuleConfig(), "Modules stage 3 gathers whole, as one unit (marked at `initialize()`, every stage).")
    sub_group_size: int = key(1_000_000_000, "Offload: elements the optimizer updates (and swaps) at a time.",
                              positive)
    allgather_partitions: bool = key(
        True, "Only `true`: the updated partitions are all-gathered after the step (stages 1-2; the all-reduce "
        "alternative would move twice the bytes).",
        lambda v: None if v is True else "true (zeroshard always all-gathers the updated partitions; the "
                                         "all-reduce alternative would move twice the bytes)")
    memory_efficient_linear: bool = key(
        True, "Accepted with either value: zeroshard computes with torch's own linear layers.")
    stage3_gather_16bit_weights_on_model_save: bool = key(
        False, "Stage 3: `save_16bit_model` gathers and writes the full weights (false: it writes nothing and "
        "warns, as DeepSpeed).")
    mics_shard_size: int = key(
        -1, "MiCS (stages 1-3): shard over groups of this many consecutive ranks (a node) and replicate across "
        "groups; gathers and reduce-scatters stay inside the group, gradient shards are all-reduced across groups "
        "once per step. -1: over all ranks. Must divide the world size.",
        lambda v: None if v == -1 or v >= 1 else "-1 (off) or a group size >= 1 that divides the world size")
    mics_hierarchical_params_gather: bool = key(
        False, "Only `false`: a MiCS group is gathered with one all-gather (keep `mics_shard_size` within a node, "
        "where the two levels would be one).",
        lambda v: None if v is False else "false (zeroshard gathers a MiCS group with one all-gather; keep "
                                          "mics_shard_size at most the ranks per node, where the two levels "
                                          "would be one)")
    zero_hpz_partition_size: int = key(
        1, "ZeRO++ hpZ (stage 3): a secondary partition of the parameters over groups of this many consecutive "
        "ranks (a node); after the first gather of each step, gathers stay inside the group. 1: off. Must divide "
        "the world size.", positive)
    zero_quantized_weights: bool = key(
        False, "ZeRO++ qwZ (stage 3): every gather of parameters for forward and backward moves them as int8, "
        "symmetric in blocks of `zero_quantized_block_size` elements with one fp32 scale each (about half of "
        "bf16's bytes, a quarter of fp32's), dequantised into the gathered unit; masters, optimizer state, "
        "checkpoints and gathers for anything but compute stay exact. With hpZ the gather over all ranks is "
        "quantised and the secondary partition keeps its dequantised values, gathered inside the node as they "
        "are (docs/MULTI_NODE.md, \"ZeRO++\").")
    zero_quantized_nontrainable_weights: bool = key(
        False, "ZeRO++ (stage 3): as `zero_quantized_weights`, for frozen parameters only (a LoRA base); their "
        "stored shards stay in their own dtype.")
    zero_quantized_gradients: bool = key(
        False, "ZeRO++ qgZ (stages 1-3): each gradient bucket is reduced by two all-to-alls of block-quantised "
        "values (`zero_quantized_gradients_bits`), inside the node then across nodes, dequantised and summed in "
        "fp32 between them, instead of a reduce-scatter; within one node one all-to-all. A rank's own part of its "
        "chunk is never quantised. Experts' buckets reduce the same way over the ranks holding the same experts "
        "(docs/MULTI_NODE.md, \"ZeRO++\").")
    zero_quantized_gradients_bits: int = key(
        4, "zeroshard's own key: bits per gradient element of `zero_quantized_gradients` (4, packed two to a "
        "byte, or 8).", lambda v: None if v in (4, 8) else "4 or 8")
    zero_quantized_block_size: int = key(
        4096, "zeroshard's own key: elements per fp32 scale of the blocks of `zero_quantized_weights` and "
        "`zero_quantized_gradients` (DeepSpeed's quantiser aims at groups of 4k-8k elements per tensor; "
        "zeroshard's blocks run over each rank's chunk, any size, the last block padded).", positive)
    host_page_reuse: bool = key(
        True, "zeroshard's own key: in host memory on Linux (a CPU run), buffers kept for the run (stage 3's "
        "gathered units and gradient chunks, every stage's gradient bucket pool) keep their addresses and give "
        "back their pages when released; the pages are parked and moved under the next buffer filled (`mremap`) "
        "instead of being faulted in again, and a gathered unit borrows this rank's chunk by moving its pages. "
        "false: a released buffer's storage is freed and allocated again at its next use, exactly as on a GPU "
        "(a CPU run then takes the GPU's path). No effect on CUDA, where released storage is always freed.")


@dataclass(frozen=True)
class TensorboardConfig:
    """``tensorboard``: DeepSpeed's block; the per-step metrics also go to TensorBoard."""

    enabled: bool = key(False, "Also write the metrics to TensorBoard (needs the `tensorboard` package).")
    output_path: str = key("", "Directory of the TensorBoard event files, which go to `output_path/job_name` "
                               "(empty: the working directory).")
    job_name: str = key("DeepSpeedJobName", "Run name: the subdirectory of `output_path` the event files go to.")


@dataclass(frozen=True)
class CSVMonitorConfig:
    """``csv_monitor``: each metric of the per-step records appended to ``output_path/job_name/<metric>.csv``."""

    enabled: bool = key(False, "Append every numeric metric of each record to `output_path/job_name/<metric>.csv` "
                               "(`step,<metric>` rows), rank 0.")
    output_path: str = key("", "Directory of the CSV files (empty: the working directory).")
    job_name: str = key("DeepSpeedJobName", "Run name: the subdirectory of `output_path` the CSV files go to.")


@dataclass(frozen=True)
class ZeroshardConfig:
    """The whole training configuration, after validation and batch-size derivation."""

    train_batch_size: Optional[int] = key(
        None, "Global batch: micro batch x accumulation x world size (any two of the three derive the third).",
        optional_positive, default_text="derived")
    train_micro_batch_size_per_gpu: Optional[int] = key(None, "Samples per rank per forward.",
                                                        optional_positive, default_text="derived")
    gradient_accumulation_steps: Optional[int] = key(None, "Micro steps per optimizer step.",
                                                     optional_positive, default_text="derived (1)")
    sequence_parallel_size: int = key(
        1, "Sequence parallelism (docs/SEQUENCE_PARALLEL.md; DeepSpeed-Ulysses, or a ring: "
        "`sequence_parallel.mode`): the ranks that split each sequence (consecutive ranks; 1: off). They hold the "
        "same parameters, ZeRO shards over data x sequence and averages gradients over both, and the batch keys "
        "count data-parallel ranks (world size / this). Must divide the world size; pipeline, tensor and expert "
        "parallelism with it are refused (not supported yet).", positive)
    compile: CompileConfig = key(CompileConfig(), "DeepSpeed's DeepCompile block (only `deepcompile: false`).")
    sequence_parallel: SequenceParallelConfig = key(
        SequenceParallelConfig(), "zeroshard's own block: how attention runs over the split sequences (Ulysses' "
        "all-to-all or a ring).")
    gradient_clipping: float = key(
        0.0, "Clip the global (all-shard) gradient norm to this value; 0 turns it off. The default is DeepSpeed's "
        "before 0.19.3 (from 0.19.3 on DeepSpeed defaults to 1.0; `initialize()` says so once when the key is "
        "absent).", non_negative)
    steps_per_print: float = key(
        10, "Every this many optimizer steps rank 0 logs loss, lr, gradient norm, samples/s, tokens/s, TFLOP/s, "
        "communication bytes and time, peak memory (`Infinity`, as Hugging Face writes it: never).",
        lambda v: None if v > 0 and (v == float("inf") or float(v).is_integer()) else "a whole number > 0, or Infinity",
        infinite_ok=True)
    wall_clock_breakdown: bool = key(
        False, "Add the seconds spent in forward, backward and step to the metrics (see `steps_per_print`).")
    metrics_path: Optional[str] = key(
        None, "zeroshard's own key: append each metrics record as one JSON line to this file (rank 0).")
    tensorboard: TensorboardConfig = key(TensorboardConfig(), "Metrics to TensorBoard.")
    seed: Optional[int] = key(
        None, "Seed torch on every rank in `initialize()` (the same value everywhere; also seeds the data loader's "
        "shuffle).")
    prescale_gradients: bool = key(
        False, "Average gradients as DeepSpeed's prescaling does: divide by `gradient_predivide_factor` before the "
        "reduction and by world size / factor after it (false: divide by the world size before).")
    gradient_predivide_factor: float = key(
        1.0, "With `prescale_gradients`: the divisor applied before the reduction (world size / factor after it).",
        positive)
    gradient_allreduce_op: Literal["mean", "sum"] = key(
        "mean", "How the data-parallel ranks' gradients are combined (any case): `mean` averages them; `sum` adds "
        "them without dividing by the world size (for a loss already normalised over the global batch; "
        "`prescale_gradients` then scales nothing). `sum` is refused at stage 3, as DeepSpeed refuses it.")
    zero_allow_untested_optimizer: bool = key(
        False, "Accepted with either value: zeroshard wraps any torch optimizer the same way, so none is untested "
        "(Hugging Face sets it).")
    zero_force_ds_cpu_optimizer: bool = key(
        True, "Accepted with either value: under CPU offload zeroshard steps the given torch optimizer on the host "
              "(Adam/AdamW with torch's fused CPU kernel).")
    collectives_in_a_world_of_one: bool = key(
        False, "zeroshard's own key: a world of one with a process group (torchrun with one process) issues every "
        "collective a larger world would, each over its one rank, instead of skipping them: a check of the "
        "communication path on one GPU, where NCCL cannot run two ranks on one device (`zeroshard selftest "
        "--nproc 1` sets it). Refused without a process group.")
    dataloader_drop_last: bool = key(
        False, "The loader `initialize(training_data=...)` returns: false (as DeepSpeed) hands out every sample, "
        "each rank's share padded by repeating samples to an equal count, the last micro batch possibly smaller; "
        "true gives only full micro batches and no repeats, leaving out up to a micro batch per rank at the end "
        "of each epoch.")
    csv_monitor: CSVMonitorConfig = key(CSVMonitorConfig(), "Metrics to CSV files, one per metric.")
    checkpoint: CheckpointConfig = key(CheckpointConfig(), "Checkpoint loading options.")
    host_memory_release: bool = key(
        False, "zeroshard's own key: at `initialize()`, fix glibc's mmap and trim thresholds at 1 MiB (`mallopt`), "
        "so that freed blocks of a MiB or more go back to the system at once and peak RSS follows live memory "
        "instead of what glibc keeps; process-wide; costs page faults (measured in `benchmarks/RESULTS.md`, "
        "section \"Opt-in memory settings\").")
    host_memory_trim: bool = key(
        False, "zeroshard's own key: after every optimizer step, give the pages of the C heap's free blocks back to "
        "the system (glibc's `malloc_trim(0)`); glibc's settings are not changed; the next step faults in again "
        "what it uses, once a step (measured in `benchmarks/RESULTS.md`, section \"Opt-in memory settings\").")
    max_consecutive_skips: int = key(
        10, "zeroshard's own key: fp32/bf16 optimizer steps skipped in a row for a non-finite gradient (every rank "
            "skips; parameters, optimizer state and LR schedule untouched; the rank whose loss was not finite is "
            "logged) before training stops with `NonFiniteGradientError` naming that rank and the first parameter "
            "with a non-finite gradient. fp16 keeps its loss-scaler rules.", positive)
    collective_timeout: float = key(
        1800.0, "Seconds a collective may wait before the job fails instead of hanging. On gloo (CPU) each wait "
        "is bounded by it and fails with `CollectiveError` naming the collective; on NCCL it is the process "
        "group's timeout, enforced by NCCL's watchdog, which ends the process with its own error (zeroshard "
        "waits for GPU collectives without a host timeout, which would stall the host until the GPU is done); "
        "a process group created before `initialize()` keeps its own timeout on NCCL.", positive
    )
    optimizer: Optional[OptimizerConfig] = key(None, "The optimizer; or pass one to initialize().")
    scheduler: Optional[SchedulerConfig] = key(None, "The learning-rate schedule, if any.")
    zero_optimization: ZeroConfig = key(ZeroConfig(), "ZeRO stage and communication settings.")
    fp16: FP16Config = key(FP16Config(), "float16 mixed precision with loss scaling.")
    bf16: BF16Config = key(BF16Config(), "bfloat16 mixed precision.")
    fp8: FP8Config = key(FP8Config(), "FP8 linear layers (docs/FP8.md).")
    communication_data_type: Optional[Literal["fp32", "fp16", "bf16"]] = key(
        None, "dtype gradients are reduced in: `fp32` or the training dtype.", default_text="training dtype")
    data_types: DataTypesConfig = key(DataTypesConfig(), "Gradient accumulation dtype.")
    activation_checkpointing: ActivationCheckpointingConfig = key(
        ActivationCheckpointingConfig(), "Settings of zeroshard.deepspeed.checkpointing.checkpoint (zeroshard/activations/checkpointing.py).")
    pipeline: PipelineConfig = key(PipelineConfig(), "Pipeline parallelism (a `PipelineModule` model only).")
    tensor_parallel: TensorParallelConfig = key(TensorParallelConfig(), "Tensor parallelism from the config (AutoTP).")

    @property
    def stage(self) -> int:
        return self.zero_optimization.stage

    def to_dict(self) -> dict[str, Any]:
        """The config as DeepSpeed-shaped JSON data (every key, defaults and derived batch sizes included)."""
        return asdict(self)

    def __getitem__(self, name: str) -> Any:
        """Read a top-level key as DeepSpeed's engine exposes its config (``config["train_batch_size"]``)."""
        if name not in self.__dataclass_fields__:
            raise KeyError(name)
        value = getattr(self, name)
        return asdict(value) if is_dataclass(value) and not isinstance(value, type) else value

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self.__dataclass_fields__ else default

    def __contains__(self, name: object) -> bool:
        return name in self.__dataclass_fields__


# DeepSpeed keys that zeroshard knows but does not implement yet: naming one is an explicit error
# (never silently ignored), keyed by the dotted path of the block that holds them.
NOT_SUPPORTED_YET: dict[str, tuple[str, ...]] = {
    "": (
        "amp", "sparse_gradients", "memory_breakdown",
        "flops_profiler", "wandb", "comms_logger", "elasticity",
        "autotuning", "compression_training", "dump_state", "hybrid_engine",
    ),
    "zero_optimization": (
        "round_robin_gradients",
        "load_from_fp32_weights", "pipeline_loading_checkpoint",
        "use_multi_rank_bucket_allreduce",
        "stage3_use_all_reduce_for_fetch_params",
    ),
    "fp16": ("auto_cast", "fp16_master_weights_and_grads"),
    "bf16": ("immediate_grad_update",),
}
