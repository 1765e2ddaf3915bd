"""The ``zeroshard`` command.

    zeroshard demo [--stage 3] [--nproc 2] [--steps 300] [--precision fp32] [--config ds.json] [--lora]
    zeroshard selftest [--device cpu|cuda] [--nproc N] [--size 125m] [--steps K] [--json out.json]
    zeroshard consolidate CKPT_DIR OUT [--dtype fp32|bf16|fp16] [--tag TAG]
    zeroshard ckpt-info CKPT_DIR [--tag TAG]
    zeroshard convert DEEPSPEED_CKPT OUT_DIR [--tag TAG]
    zeroshard convert CKPT OUT_DIR --to deepspeed --world-size N --stage S [--dtype fp32|bf16] [--tag TAG]
    zeroshard estimate --params 7e9 --gpus-per-node 8 [--gpu-memory 80] [--micro-batch 1 --seq-len 4096 ...]
    zeroshard estimate --params 70e9 --nodes 128 --gpus-per-node 8 --intra-node-bw 900GB/s \
        --inter-node-bw 50GB/s --tflops 400 --seq-len 4096 --micro-batch 1 [--grad-accum 1] [--gpu-memory 80]
    zeroshard estimate --params 70e9 --nodes 4 --gpus-per-node 8 --pp 4 [--schedule gpipe] [--grad-accum 8] ...
    zeroshard estimate --params 47e9 --gpus-per-node 8 --experts 8 --ep 8 --topk 2 --expert-params 176e6 --layers 32
    zeroshard estimate --params 8e9 --gpus-per-node 8 --tp 2 --hidden 4096 --layers 32 --heads 32 --kv-heads 8 \
        --ffn 14336 --micro-batch 1 --seq-len 4096
    zeroshard estimate --params 70e9 --hidden 8192 --layers 80 --heads 64 --kv-heads 8 --ffn 28672 --nodes 16 \
        --gpus-per-node 8 --intra-node-bw 900GB/s --inter-node-bw 50GB/s --tflops 400 --seq-len 4096 \
        --micro-batch 1 --gpu-memory 80 --search-parallel [--tp T] [--pp P]
    zeroshard plot METRICS.jsonl -o out.png
    zeroshard env
    zeroshard run [torchrun options] script.py [args]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from typing import TYPE_CHECKING, Optional, Sequence

from .selftest.command import add_parser as add_selftest_parser
from .convert_cli import add_convert

if TYPE_CHECKING:
    from ..config import ZeroshardConfig
    from ..planning import Cluster, EstimateRequest
    from ..planning.estimate_request import MoEShape, PipelineShape, SequenceShape, TensorShape


def _demo_nproc(requested: Optional[int], cuda_devices: int) -> int:
    """The demo's ranks: as asked, else 2, or on a GPU host one per GPU up to 2; more ranks than GPUs is
    refused here rather than by CUDA's "invalid device ordinal" in a rank."""
    if requested is None:
        return min(2, cuda_devices) if cuda_devices else 2
    if requested < 1:
        raise SystemExit(f"zeroshard demo: --nproc {requested}: give at least 1")
    if cuda_devices and requested > cuda_devices:
        raise SystemExit(f"zeroshard demo: --nproc {requested} but this host has {cuda_devices} CUDA device(s) and "
                         f"each rank trains on a GPU of its own: --nproc {cuda_devices} or fewer (or hide the GPUs "
                         f"with CUDA_VISIBLE_DEVICES= to train on the CPU)")
    return requested


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _demo(args: argparse.Namespace) -> int:
    nproc = _demo_nproc(args.nproc, _cuda_devices())
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", "-m", "zeroshard.tools.demo.train",
               "--stage", str(args.stage), "--steps", str(args.steps), "--precision", args.precision]
    if args.config:
        command += ["--config", args.config]
    command += ["--out", args.out] + (["--lora"] if args.lora else [])
    print("+ " + " ".join(command), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call(command, env=env)


def _consolidate(args: argparse.Namespace) -> int:
    from ..checkpoint import consolidate

    target = consolidate(args.checkpoint, args.out, dtype=args.dtype, tag=args.tag,
                         trainable_only=args.trainable_only)
    print(f"wrote {target}")
    return 0


def _ckpt_info(args: argparse.Namespace) -> int:
    from ..checkpoint import describe

    print(describe(args.checkpoint, tag=args.tag))
    return 0


def _model_numbers(args: argparse.Namespace) -> tuple[float, dict, Optional[dict]]:
    """Parameter count, shape and MoE layout (a Mixtral-style --hf-config's, else None) from --params,
    --model module:factory, or --hf-config config.json."""
    import importlib

    import torch

    from ..planning.estimate_request import moe_from_hf_config

    shape: dict = {}
    moe: Optional[dict] = None
    if args.model or args.hf_config:
        with torch.device("meta"):  # count without allocating
            if args.model:
                module, _, factory = args.model.partition(":")
                model = getattr(importlib.import_module(module), factory)()
            else:
                import json
                from pathlib import Path

                import transformers

                path = Path(args.hf_config)
                path = path / "config.json" if path.is_dir() else path
                if not path.is_file():
                    raise SystemExit(f"zeroshard estimate: {path} does not exist (a local config.json is needed; "
                                     f"nothing is downloaded)")
                raw = json.loads(path.read_text())
                config = transformers.AutoConfig.for_model(**raw)
                model = transformers.AutoModelForCausalLM.from_config(config)
                shape = {"hidden": getattr(config, "hidden_size", None),
                         "layers": getattr(config, "num_hidden_layers", None),
                         "heads": getattr(config, "num_attention_heads", None),
                         "kv_heads": getattr(config, "num_key_value_heads", None),
                         "ffn": getattr(config, "intermediate_size", None)}
                moe = moe_from_hf_config(config.to_dict())
        return float(sum(p.numel() for p in model.parameters())), shape, moe
    if args.params is None:
        raise SystemExit("zeroshard estimate: give --params, --model module:factory or --hf-config")
    return float(args.params), shape, moe


_SCALE_LINKS = ("intra_node_bw", "inter_node_bw", "tflops")
_SCALE_ONLY = ("mics_shard_size", "hpz_partition_size", "search_parallel")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _scale_mode(args: argparse.Namespace) -> bool:
    """Whether the options ask for the scale model; refuses a half-given one with the missing options."""
    given = [n for n in _SCALE_LINKS if getattr(args, n) is not None]
    if not given:
        extra = [_flag(n) for n in _SCALE_ONLY if getattr(args, n) is not None]
        if extra:
            raise SystemExit(f"zeroshard estimate: {', '.join(extra)} belong(s) to the scale model: also give "
                             f"--intra-node-bw, --inter-node-bw and --tflops (e.g. 900GB/s 50GB/s 400)")
        return False
    missing = [_flag(n) for n in _SCALE_LINKS if getattr(args, n) is None]
    if missing:
        raise SystemExit(f"zeroshard estimate: the scale model needs --intra-node-bw, --inter-node-bw and --tflops; "
                         f"missing {', '.join(missing)} (e.g. --intra-node-bw 900GB/s --inter-node-bw 50GB/s "
                         f"--tflops 400)")
    if not (args.micro_batch and args.seq_len):
        raise SystemExit("zeroshard estimate: the scale model needs --micro-batch and --seq-len (tokens per micro "
                         "step), e.g. --micro-batch 1 --seq-len 4096")
    return True


def _cluster(args: argparse.Namespace) -> "Cluster":
    """The --nodes/--gpus-per-node/--*-bw/--tflops options as a Cluster, with errors that name the option."""
    from ..planning import Cluster, parse_bandwidth

    speeds = {}
    for name in ("intra_node_bw", "inter_node_bw"):
        try:
            speeds[name] = parse_bandwidth(getattr(args, name))
        except ValueError as err:
            raise SystemExit(f"zeroshard estimate: {_flag(name)} {err}") from None
    if not args.tflops > 0:
        raise SystemExit(f"zeroshard estimate: --tflops {args.tflops:g}: give the achieved TFLOPS per GPU, > 0 "
                         f"(e.g. 400 for an H100 at 40% of its dense bf16 peak)")
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise SystemExit("zeroshard estimate: --nodes and --gpus-per-node must be at least 1")
    return Cluster(args.nodes, args.gpus_per_node, speeds["intra_node_bw"], speeds["inter_node_bw"], args.tflops)


def _group_sizes(args: argparse.Namespace, world_size: int) -> tuple[list[int], list[int]]:
    """--mics-shard-size and --hpz-partition-size values, refused unless they divide the world."""
    sizes: dict[str, list[int]] = {}
    for name, low in (("mics_shard_size", 1), ("hpz_partition_size", 2)):
        sizes[name] = list(getattr(args, name) or [])
        for size in sizes[name]:
            if size < low or world_size % size:
                raise SystemExit(f"zeroshard estimate: {_flag(name)} {size} does not divide the {world_size} ranks "
                                 f"(--nodes {args.nodes} x --gpus-per-node {args.gpus_per_node}): choose a divisor "
                                 f"of {world_size} of at least {low}, usually --gpus-per-node ({args.gpus_per_node})")
    return sizes["mics_shard_size"], sizes["hpz_partition_size"]


def _grad_bytes(args: argparse.Namespace, config: "ZeroshardConfig") -> Optional[int]:
    """Bytes per held gradient element, as the engine decides it for ``--precision`` and the config's
    ``data_types.grad_accum_dtype`` / ``communication_data_type`` / ``gradient_accumulation_steps``
    (``--grad-accum`` wins over the last): bf16 accumulating over several micro steps holds fp32."""
    from ..precision.policy import DTYPES, default_grad_accum

    if args.precision == "fp32":
        return None
    held = config.data_types.grad_accum_dtype or default_grad_accum(
        args.precision, config.communication_data_type or args.precision, _micro_steps(args, config))
    return DTYPES[held].itemsize


def _micro_steps(args: argparse.Namespace, config: "ZeroshardConfig") -> int:
    return args.grad_accum or config.gradient_accumulation_steps or 1


_MOE_FLAGS = ("experts", "ep", "topk", "expert_params", "moe_layers", "capacity_factor", "min_capacity")
_TP_FLAGS = ("tp", "tp_params", "kv_heads", "ffn")


def _pipeline(args: argparse.Namespace, config: "ZeroshardConfig") -> Optional["PipelineShape"]:
    """--pp and --schedule (default: the config's ``pipeline`` section) as a PipelineShape; None: none."""
    from ..planning.estimate_request import PipelineShape

    stages = args.pp if args.pp is not None else config.pipeline.stages
    if stages is None:
        if args.schedule is not None:
            raise SystemExit("zeroshard estimate: --schedule belongs to a pipeline: also give --pp STAGES")
        return None
    schedule = args.schedule or config.pipeline.schedule
    chunks = args.virtual_stages or config.pipeline.virtual_stages or (2 if schedule == "interleaved_1f1b" else 1)
    return PipelineShape(stages, schedule, config.pipeline.stage3_gather_per_micro_batch, chunks)


def _tensor(args: argparse.Namespace, config: "ZeroshardConfig", derived: dict) -> Optional["TensorShape"]:
    """--tp (default: the config's ``tensor_parallel.autotp_size`` when above 1), --tp-params, --kv-heads
    and --ffn (defaults from an --hf-config) as a TensorShape; None: no tensor parallelism."""
    from ..planning.estimate_request import TensorShape

    size = args.tp if args.tp is not None else (config.tensor_parallel.autotp_size or None)
    if size is None or (args.tp is None and size == 1):
        sequence = (args.sp or config.sequence_parallel_size) > 1  # --kv-heads sizes its exchanges too
        extra = [_flag(n) for n in _TP_FLAGS[1:] if getattr(args, n) is not None
                 and not (sequence and n == "kv_heads")]
        if extra and not args.search_parallel:
            raise SystemExit(f"zeroshard estimate: {', '.join(extra)} belong(s) to tensor parallelism: also give "
                             f"--tp T (or --search-parallel)")
        return None
    return dataclasses.replace(_tensor_split(args, derived), size=size)


def _sequence(args: argparse.Namespace, config: "ZeroshardConfig", derived: dict) -> Optional["SequenceShape"]:
    """--sp (default: the config's ``sequence_parallel_size`` when above 1) and --sp-mode (default: the
    config's ``sequence_parallel.mode``) as a SequenceShape, with --kv-heads (or the --hf-config's);
    None: no sequence parallelism."""
    from ..planning.estimate_request import SequenceShape

    size = args.sp if args.sp is not None else config.sequence_parallel_size
    if args.sp is None and size == 1:
        if args.sp_mode is not None:
            raise SystemExit("zeroshard estimate: --sp-mode belongs to sequence parallelism: also give --sp P")
        return None
    kv_heads = args.kv_heads if args.kv_heads is not None else derived.get("kv_heads")
    return SequenceShape(size, args.sp_mode or config.sequence_parallel.mode, kv_heads)


def _tensor_split(args: argparse.Namespace, derived: dict) -> "TensorShape":
    """What --tp-params, --kv-heads and --ffn (defaults from an --hf-config) say about the split
    parameters, for a tensor-parallel size of 1 until one is chosen."""
    from ..planning.estimate_request import TensorShape

    kv_heads = args.kv_heads if args.kv_heads is not None else derived.get("kv_heads")
    return TensorShape(1, args.tp_params, kv_heads, args.ffn if args.ffn is not None else derived.get("ffn"))


def _moe(args: argparse.Namespace, derived: Optional[dict], layers: Optional[int]) -> Optional["MoEShape"]:
    """The MoE flags, completed from a Mixtral-style --hf-config, as a MoEShape; None when none is given."""
    from ..planning.estimate_request import MoEShape

    given = [n for n in _MOE_FLAGS if getattr(args, n) is not None]
    if not given:
        return None
    derived = derived or {}
    experts = args.experts if args.experts is not None else derived.get("num_experts")
    if experts is None:
        raise SystemExit(f"zeroshard estimate: {', '.join(_flag(n) for n in given)} describe(s) MoE layers: also "
                         f"give --experts E (or an --hf-config with num_local_experts / num_experts)")
    expert_params = args.expert_params if args.expert_params is not None else derived.get("expert_params")
    if expert_params is None:
        raise SystemExit("zeroshard estimate: --experts needs --expert-params, the parameters of one expert "
                         "(a SwiGLU expert: 3 x hidden x ffn)")
    moe_layers = args.moe_layers if args.moe_layers is not None else derived.get("moe_layers", layers)
    if moe_layers is None:
        raise SystemExit("zeroshard estimate: --experts needs --moe-layers (or --layers: every layer is an MoE "
                         "layer)")
    topk = args.topk if args.topk is not None else derived.get("topk", 1)
    if args.topk is None and topk not in (1, 2):
        raise SystemExit(f"zeroshard estimate: the config routes each token to {topk} experts "
                         f"(num_experts_per_tok) and zeroshard's MoE to 1 or 2: give --topk 1 or 2")
    return MoEShape(experts, expert_params, moe_layers, args.ep if args.ep is not None else 1, topk,
                    1.0 if args.capacity_factor is None else args.capacity_factor,
                    4 if args.min_capacity is None else args.min_capacity)


def _estimate(args: argparse.Namespace) -> int:
    from ..config import load_config
    from ..planning import EstimateRequest, ModelShape, estimate_all, format_table
    from ..planning.estimate_request import EstimateError, check_parallel
    from ..planning.quantised_traffic import Quantisation

    scale = _scale_mode(args)
    experts = [_flag(n) for n in _MOE_FLAGS if getattr(args, n) is not None]
    if scale and experts:
        raise SystemExit(f"zeroshard estimate: {', '.join(experts)}: the scale model does not know experts; leave "
                         f"out --intra-node-bw, --inter-node-bw and --tflops for their memory")
    if args.grad_accum is not None and args.grad_accum < 1:
        raise SystemExit(f"zeroshard estimate: --grad-accum {args.grad_accum}: give the micro steps per optimizer "
                         f"step, at least 1")
    if not 0 < args.trainable <= 1:
        raise SystemExit(f"zeroshard estimate: --trainable {args.trainable}: give the fraction of parameters that "
                         f"train, in (0, 1] (a LoRA job: about 0.01)")
    num_params, shape, derived_moe = _model_numbers(args)
    shape = {k: v for k, v in shape.items() if v}
    derived_tensor = {k: shape.pop(k) for k in ("kv_heads", "ffn") if k in shape}
    shape.update({k: v for k, v in (("hidden", args.hidden), ("layers", args.layers), ("heads", args.heads)) if v})
    config = load_config(args.config) if args.config else load_config({})
    zero = config.zero_optimization
    req = EstimateRequest(num_params=num_params, world_size=args.gpus_per_node * args.nodes,
                          precision="fp32" if args.precision == "fp32" else "mixed", offload=args.offload,
                          micro_batch=args.micro_batch, seq_len=args.seq_len, checkpointing=args.checkpointing,
                          flash_attention=args.flash_attention,
                          shape=ModelShape(**shape), reduce_bucket_size=zero.reduce_bucket_size,
                          prefetch_bucket_size=zero.stage3_prefetch_bucket_size, trainable=args.trainable,
                          grad_bytes=_grad_bytes(args, config), micro_steps=_micro_steps(args, config),
                          pipeline=_pipeline(args, config), moe=_moe(args, derived_moe, shape.get("layers")),
                          tensor=_tensor(args, config, derived_tensor),
                          sequence=_sequence(args, config, derived_tensor),
                          fp8=bool(args.fp8 if args.fp8 is not None else config.fp8.enabled),
                          quantisation=Quantisation.from_zero_config(zero))
    try:
        check_parallel(req)
    except EstimateError as err:
        raise SystemExit(f"zeroshard estimate: {err}") from None
    estimates = estimate_all(req)
    if scale:
        print(_scale_table(args, req, _micro_steps(args, config), _tensor_split(args, derived_tensor)))
    else:
        print(format_table(req, estimates, args.gpu_memory))
    if args.plot:
        from .plots import plot_estimate

        print(f"plot: {plot_estimate(estimates, args.plot, f'{num_params:.3g} parameters on {req.world_size} ranks')}")
    return 0


def _scale_table(args: argparse.Namespace, req: "EstimateRequest", micro_steps: int, split: "TensorShape") -> str:
    """The scale model's table (zeroshard/planning/scale_model.py) for the parsed options; with --tp, --pp
    or --search-parallel the layouts' (zeroshard/planning/parallel_search.py)."""
    from ..planning import default_shardings, format_scale_table, scale_estimates

    cluster = _cluster(args)
    mics, hpz = _group_sizes(args, cluster.world_size)
    if args.search_parallel or req.tensor is not None or req.pipeline is not None:
        return _layout_table(args, req, cluster, micro_steps, mics, hpz, split)
    shardings = default_shardings(cluster.world_size, cluster.gpus_per_node, mics, hpz)
    table = format_scale_table(req, cluster, scale_estimates(req, cluster, shardings, micro_steps), args.gpu_memory,
                               micro_steps)
    if args.offload:
        table += "\nnote: offload traffic over PCIe/NVMe is not in the time model; memory shows what stays on the GPU"
    if cluster.world_size <= cluster.gpus_per_node and not (mics or hpz):
        table += "\nnote: one node: MiCS and hpZ with a group of one node are plain ZeRO, not listed"
    return table


def _layout_table(args: argparse.Namespace, req: "EstimateRequest", cluster: "Cluster", micro_steps: int,
                  mics: list[int], hpz: list[int], split: "TensorShape") -> str:
    """The table of tensor x data x pipeline layouts: every one with --search-parallel (--tp / --pp fix
    their axis; ``split`` says how the tensor-parallel sizes split the model), else the one --tp / --pp
    give, with each of its shardings."""
    from ..distributed.parallel_dims import ParallelDims
    from ..planning.estimate_request import EstimateError, pipeline_stage_count, tensor_parallel_size
    from ..planning.parallel_search import (format_layout_table, layout_estimates, layout_shardings, refused_layouts,
                                            search_layouts)

    tp, pp = tensor_parallel_size(req), pipeline_stage_count(req)
    refused = None
    try:
        if args.search_parallel:
            if not (req.shape.hidden and req.shape.layers):
                raise EstimateError("--search-parallel needs the model's shape for the tensor-parallel split, the "
                                    "activations and the bytes between ranks: --hf-config, or --hidden, --layers "
                                    "and --heads")
            searched = req if req.tensor is not None else dataclasses.replace(req, tensor=split)
            fixed_tp = [tp] if req.tensor is not None else None
            fixed_pp = [pp] if req.pipeline is not None else None
            estimates = search_layouts(searched, cluster, micro_steps, mics, hpz, fixed_tp, fixed_pp)
            refused = refused_layouts(searched, cluster, fixed_tp, fixed_pp)
        else:
            dims = ParallelDims(pp, cluster.world_size // (tp * pp), tp)
            estimates = layout_estimates(req, cluster, dims, layout_shardings(dims, cluster.gpus_per_node, mics, hpz),
                                         micro_steps)
    except EstimateError as err:
        raise SystemExit(f"zeroshard estimate: {err}") from None
    if not estimates:
        reasons = "; ".join(refused or {})
        raise SystemExit(f"zeroshard estimate: no layout to compare: {reasons}")
    table = format_layout_table(req, cluster, estimates, args.gpu_memory, micro_steps, bool(args.search_parallel),
                                refused)
    if args.offload:
        table += "\nnote: offload traffic over PCIe/NVMe is not in the time model; memory shows what stays on the GPU"
    return table


def _plot(args: argparse.Namespace) -> int:
    from .plots import plot_metrics

    print(f"plot: {plot_metrics(args.metrics, args.output)}")
    return 0


def _env(args: argparse.Namespace) -> int:
    import importlib.util
    import platform

    import torch
    import torch.distributed as dist

    from ..version import __version__

    rows = [("zeroshard", __version__), ("python", platform.python_version()), ("torch", torch.__version__),
            ("cuda available", str(torch.cuda.is_available())),
            ("cuda devices", str(torch.cuda.device_count()) if torch.cuda.is_available() else "0"),
            ("torch.version.cuda", str(torch.version.cuda)),
            ("backends", ", ".join(b for b, ok in (("gloo", dist.is_gloo_available()),
                                                  ("nccl", dist.is_nccl_available()),
                                                  ("mpi", dist.is_mpi_available())) if ok))]
    for extra in ("transformers", "accelerate", "peft", "safetensors", "matplotlib", "tensorboard"):
        spec = importlib.util.find_spec(extra)
        rows.append((extra, "installed" if spec else "not installed"))
    for name, value in rows:
        print(f"{name:<20} {value}")
    return 0


def _run(args: argparse.Namespace) -> int:
    return _torchrun(args.torchrun_args)


def _torchrun(argv: Sequence[str]) -> int:
    """torchrun with the user's arguments (multi-node: torchrun's own flags); DeepSpeed launcher flags
    and ``--as-deepspeed`` are translated first (zeroshard/deepspeed/launcher.py)."""
    from ..deepspeed.launcher import LauncherArgumentError, torchrun_arguments, torchrun_environment

    try:
        torchrun_args = torchrun_arguments(argv)
    except LauncherArgumentError as err:
        print(f"zeroshard run: {err}", file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "torch.distributed.run", *torchrun_args]
    print("+ " + " ".join(command), flush=True)
    return subprocess.call(command, env=torchrun_environment(os.environ))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zeroshard", description="ZeRO sharded data-parallel training")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a byte-level GPT on the Python stdlib with N processes (CPU, or "
                                                "one per GPU)")
    demo.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3], help="ZeRO stage (default 3)")
    demo.add_argument("--nproc", type=int, help="processes (default 2; on a GPU host one per GPU, at most 2)")
    demo.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    demo.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                      help="training precision of the built-in config (default fp32; bf16/fp16 keep fp32 masters)")
    demo.add_argument("--config", help="a DeepSpeed-style JSON config to use instead of the built-in one")
    demo.add_argument("--out", default="runs/demo", help="where the checkpoint and the weights go (runs/demo)")
    demo.add_argument("--lora", action="store_true",
                      help="fine-tune OUT/model.safetensors of an earlier run with LoRA adapters (frozen base "
                           "sharded at stage 3); results in OUT/lora")
    demo.set_defaults(run=_demo)
    add_selftest_parser(commands)
    cons = commands.add_parser("consolidate", help="write a checkpoint's full weights as one safetensors file "
                                                   "(no process group, bounded memory)")
    cons.add_argument("checkpoint", help="a checkpoint directory, or a save_dir with a 'latest' file")
    cons.add_argument("out", help="OUT.safetensors, or a directory (model.safetensors + config.json for HF models)")
    cons.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    cons.add_argument("--tag", help="which tag under a save_dir (default: latest)")
    cons.add_argument("--trainable-only", action="store_true",
                      help="only the trained parameters: a peft adapter directory for a peft model")
    cons.set_defaults(run=_consolidate)
    info = commands.add_parser("ckpt-info", help="print what a checkpoint holds (and verify its checksums)")
    info.add_argument("checkpoint")
    info.add_argument("--tag")
    info.set_defaults(run=_ckpt_info)
    add_convert(commands)
    est = commands.add_parser("estimate", help="per-rank memory of ZeRO stages 0-3, and which stage fits")
    est.add_argument("--params", type=float, help="parameter count, e.g. 7e9")
    est.add_argument("--model", help="module:factory building the model (counted on the meta device)")
    est.add_argument("--hf-config", help="a Hugging Face config.json (or its directory)")
    est.add_argument("--gpus-per-node", type=int, default=1)
    est.add_argument("--nodes", type=int, default=1)
    est.add_argument("--precision", choices=["fp16", "bf16", "fp32"], default="bf16")
    est.add_argument("--offload", choices=["optimizer", "params"])
    est.add_argument("--trainable", type=float, default=1.0,
                     help="fraction of parameters that train (LoRA: ~0.01); the rest are frozen, held in the "
                          "training dtype, sharded at stage 3")
    est.add_argument("--micro-batch", type=int)
    est.add_argument("--seq-len", type=int)
    est.add_argument("--hidden", type=int)
    est.add_argument("--layers", type=int)
    est.add_argument("--heads", type=int)
    est.add_argument("--checkpointing", action="store_true", help="activation checkpointing on")
    est.add_argument("--flash-attention", action="store_true", help="attention holds no s x s scores (fused kernels)")
    est.add_argument("--fp8", action="store_true", default=None,
                     help="FP8 linear layers (default: the config's fp8.enabled): stage 3 gathers their weights "
                          "at one byte per element (docs/FP8.md)")
    est.add_argument("--grad-accum", type=int,
                     help="micro steps per optimizer step (default: the config's gradient_accumulation_steps, "
                          "else 1); under bf16 more than one holds gradients in fp32")
    est.add_argument("--gpu-memory", type=float, help="GB per GPU: recommend the lowest stage that fits")
    est.add_argument("--config", help="a DeepSpeed-style JSON config (bucket sizes for the buffers)")
    est.add_argument("--plot", help="also draw stacked bars per stage to this PNG (needs matplotlib)")
    scale = est.add_argument_group("scale model", "time and traffic per optimizer step of stages 0-3, MiCS and hpZ, "
                                                  "with --tp/--pp or --search-parallel over tensor x data x pipeline "
                                                  "layouts (all three of --intra-node-bw, --inter-node-bw, --tflops "
                                                  "turn it on)")
    scale.add_argument("--intra-node-bw", help="bandwidth one GPU sends inside its node, e.g. 900GB/s or 3600Gbps")
    scale.add_argument("--inter-node-bw", help="network bandwidth per GPU (node NICs / GPUs), e.g. 50GB/s or 400Gbps")
    scale.add_argument("--tflops", type=float, help="achieved model TFLOPS per GPU (6 x params per token), e.g. 400")
    scale.add_argument("--mics-shard-size", type=int, action="append",
                       help="also model MiCS with this shard group size (repeatable; gpus-per-node is always shown)")
    scale.add_argument("--hpz-partition-size", type=int, action="append",
                       help="also model hpZ with this partition size (repeatable; gpus-per-node is always shown)")
    scale.add_argument("--search-parallel", action="store_true", default=None,
                       help="compare every tensor x data x pipeline layout (tp divides --gpus-per-node and the "
                            "heads, pp the rest) at the same global batch (ranks x micro-batch x grad-accum "
                            "sequences) and recommend (tp, pp, dp, stage); --tp / --pp fix an axis; needs "
                            "--hf-config or --hidden/--layers/--heads.  Without it, --tp / --pp model that one "
                            "layout")
    par = est.add_argument_group("pipeline and experts", "memory of one rank of a pipeline or an MoE model, the "
                                                         "pipeline bubble and the bytes between stages and experts")
    par.add_argument("--pp", type=int, help="pipeline stages P (must divide the ranks; default: the config's "
                                            "pipeline.stages): P stages x ranks/P data-parallel ranks")
    par.add_argument("--schedule", choices=["1f1b", "gpipe", "interleaved_1f1b"],
                     help="pipeline schedule (default: the config's, else 1f1b); micro-batches: --grad-accum")
    par.add_argument("--virtual-stages", type=int,
                     help="chunks per stage of the interleaved schedule (default: the config's, else 2)")
    par.add_argument("--experts", type=int, help="experts E per MoE layer (DeepSpeed's MoE)")
    par.add_argument("--ep", type=int, help="expert-parallel size (default 1; divides the experts and the ranks)")
    par.add_argument("--topk", type=int, help="experts per token, 1 or 2 (default 1, or the --hf-config's)")
    par.add_argument("--expert-params", type=float,
                     help="parameters of one expert (a SwiGLU expert: 3 x hidden x ffn); --params counts all")
    par.add_argument("--moe-layers", type=int, help="MoE layers (default: --layers, every layer)")
    par.add_argument("--capacity-factor", type=float, help="MoE capacity factor (default 1.0)")
    par.add_argument("--min-capacity", type=int, help="MoE minimum capacity per expert (default 4)")
    tp = est.add_argument_group("tensor parallelism", "memory of one rank of an AutoTP job (tensor_parallel."
                                                      "autotp_size) and its tensor-parallel all-reduce bytes")
    tp.add_argument("--tp", type=int, help="tensor-parallel size T (divides the ranks and the heads; default: the "
                                           "config's tensor_parallel.autotp_size): T x ranks/T data-parallel ranks")
    tp.add_argument("--tp-params", type=float,
                    help="parameters split over the T ranks (default: a Llama-style decoder's linear layers, "
                         "layers x (2h^2 + 2h x h_kv + 3h x ffn)); the rest stay whole on every rank")
    tp.add_argument("--kv-heads", type=int, help="key/value heads (GQA; default --heads, or the --hf-config's)")
    tp.add_argument("--ffn", type=int, help="MLP intermediate size (default 4 x --hidden, or the --hf-config's)")
    sp = est.add_argument_group("sequence parallelism", "activations of one rank of a sequence-parallel job and its "
                                                        "all-to-all (Ulysses) or ring bytes per attention layer")
    sp.add_argument("--sp", type=int, help="sequence-parallel size P (divides the ranks and --seq-len; default: the "
                                           "config's sequence_parallel_size)")
    sp.add_argument("--sp-mode", choices=["ulysses", "ring"],
                    help="how attention sees whole sequences (default: the config's sequence_parallel.mode)")
    est.set_defaults(run=_estimate)
    plot = commands.add_parser("plot", help="loss, throughput and memory over steps from a metrics JSONL file")
    plot.add_argument("metrics")
    plot.add_argument("-o", "--output", default="metrics.png")
    plot.set_defaults(run=_plot)
    env = commands.add_parser("env", help="torch version, CUDA, distributed backends, optional extras")
    env.set_defaults(run=_env)
    run = commands.add_parser("run", help="torchrun: zeroshard run [--as-deepspeed] [--num_gpus N] --nproc_per_node 2 "
                                          "train.py ...")
    run.add_argument("torchrun_args", nargs=argparse.REMAINDER)
    run.set_defaults(run=_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # everything after `run` belongs to torchrun, flags included
        return _torchrun(argv[1:])
    args = build_parser().parse_args(argv)
    from ..checkpoint import CheckpointError

    try:
        return int(args.run(args))
    except CheckpointError as err:
        print(f"zeroshard {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
