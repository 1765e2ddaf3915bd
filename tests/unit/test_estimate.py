"""`zeroshard estimate`, `env` and `run`: the seeds' 7B table to the digit, and every flag."""

import dataclasses
import json
import subprocess
import sys

import pytest

from zeroshard.tools.cli import main
from zeroshard.planning import EstimateRequest, ModelShape, estimate_all, recommend

GB = 1e9


def test_reproduces_the_seed_table_for_7b_on_8_gpus() -> None:
    estimates = estimate_all(EstimateRequest(7e9, 8, "mixed"))
    assert [e.model_states / GB for e in estimates] == [112, 38.5, 26.25, 14]


def test_fp32_formulas() -> None:
    psi, n = 1e9, 4
    assert [e.model_states for e in estimate_all(EstimateRequest(psi, n, "fp32"))] == [
        16 * psi, 8 * psi + 8 * psi / n, 4 * psi + 12 * psi / n, 16 * psi / n]


def test_offload_moves_state_to_the_host() -> None:
    opt = estimate_all(EstimateRequest(7e9, 8, "mixed", offload="optimizer"))
    assert opt[2].optimizer == 0 and opt[2].host == 10.5 * GB
    params = estimate_all(EstimateRequest(7e9, 8, "mixed", offload="params"))
    assert params[3].params == 0 and params[3].host == (10.5 + 1.75) * GB
    # fp32 training offloads an fp32 copy of the shard beside the Adam moments: 12 bytes per element
    fp32 = estimate_all(EstimateRequest(7e9, 8, "fp32", offload="optimizer"))
    assert fp32[1].host == 12 * 7e9 / 8 and fp32[1].optimizer == 0


def test_activations_and_checkpointing() -> None:
    shape = ModelShape(hidden=4096, layers=32, heads=32)
    full = estimate_all(EstimateRequest(7e9, 8, micro_batch=1, seq_len=4096, shape=shape))[3]
    ckpt = estimate_all(EstimateRequest(7e9, 8, micro_batch=1, seq_len=4096, shape=shape, checkpointing=True))[3]
    per_layer = 4096 * 4096 * (34 + 5 * 32 * 4096 / 4096)
    assert full.activations == pytest.approx(32 * per_layer)
    assert ckpt.activations == pytest.approx(32 * 2 * 4096 * 4096 + per_layer)
    assert ckpt.activations < full.activations / 10


def test_recommendation() -> None:
    estimates = estimate_all(EstimateRequest(7e9, 8, "mixed"))
    assert recommend(estimates, 80) == 1  # 38.5 GB fits 80 GB with headroom; 112 does not
    assert recommend(estimates, 20) == 3  # 14 GB of model states + 2.1 GB of buffers
    assert recommend(estimates, 10) is None


def test_cli_estimate_prints_the_table_and_a_recommendation(tmp_path, capsys) -> None:
    assert main(["estimate", "--params", "7e9", "--gpus-per-node", "8", "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    for row in ("| 0 | 14 | 14 | 84 | 112 |", "| 1 | 14 | 14 | 10.5 | 38.5 |", "| 2 | 14 | 1.75 | 10.5 | 26.25 |",
                "| 3 | 1.75 | 1.75 | 10.5 | 14 |"):
        assert row in out
    assert "ZeRO stage 1 is the lowest that fits 80 GB" in out
    assert main(["estimate", "--params", "1e9", "--gpus-per-node", "2", "--nodes", "2", "--precision", "fp32",
                 "--offload", "optimizer", "--micro-batch", "2", "--seq-len", "128", "--hidden", "1024",
                 "--layers", "4", "--heads", "8", "--checkpointing"]) == 0
    out = capsys.readouterr().out
    assert "1e+09 parameters, 4 ranks, fp32 (Adam), offload optimizer" in out
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": 1e6,
                                                        "stage3_prefetch_bucket_size": 1e6}}))
    assert main(["estimate", "--params", "1e9", "--gpus-per-node", "4", "--precision", "fp16",
                 "--offload", "params", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    # stage 3: params and optimizer on the host; buffers: 2 gradient buckets + the prefetch, 16-bit
    assert "| 3 | 0 | 0.5 | 0 | 0.5 | 0 | 0.006 | 0.506 | 3.5 |" in out


def test_cli_estimate_counts_fp32_gradients_where_bf16_accumulates(tmp_path, capsys) -> None:
    """bf16 over several micro steps holds fp32 gradients ([Note: the dtypes of mixed precision]): 4 bytes
    an element, from --grad-accum or the config's gradient_accumulation_steps; fp16, or a grad_accum_dtype
    set to bf16, keeps 2."""
    base = ["estimate", "--params", "7e9", "--gpus-per-node", "8"]
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"gradient_accumulation_steps": 4, "bf16": {"enabled": True}}))
    for extra in (["--grad-accum", "4"], ["--config", str(config)]):
        assert main(base + extra) == 0
        out = capsys.readouterr().out
        assert "mixed precision (16-bit params/grads, fp32 Adam), gradients held in fp32" in out
        assert "| 0 | 14 | 28 | 84 | 126 |" in out and "| 2 | 14 | 3.5 | 10.5 | 28 |" in out
    config.write_text(json.dumps({"gradient_accumulation_steps": 4, "bf16": {"enabled": True},
                                  "data_types": {"grad_accum_dtype": "bf16"}}))
    for extra in (["--config", str(config)], ["--precision", "fp16", "--grad-accum", "4"]):
        assert main(base + extra) == 0
        out = capsys.readouterr().out
        assert "held in fp32" not in out and "| 2 | 14 | 1.75 | 10.5 | 26.25 |" in out


def test_cli_estimate_from_a_model_factory_and_a_hf_config(tmp_path, capsys) -> None:
    assert main(["estimate", "--model", "zeroshard.tools.demo.model:demo_gpt", "--gpus-per-node", "2"]) == 0
    from zeroshard.tools.demo.model import GPTConfig

    assert f"{float(GPTConfig().num_params()):.3g} parameters, 2 ranks" in capsys.readouterr().out
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    assert main(["estimate", "--hf-config", str(tmp_path), "--gpus-per-node", "2", "--micro-batch", "1",
                 "--seq-len", "128"]) == 0
    out = capsys.readouterr().out
    n = sum(p.numel() for p in transformers.GPT2LMHeadModel(cfg).parameters())
    assert f"{float(n):.3g} parameters, 2 ranks" in out
    with pytest.raises(SystemExit, match="does not exist"):
        main(["estimate", "--hf-config", str(tmp_path / "nope.json")])


def test_cli_env_and_run(tmp_path) -> None:
    env = subprocess.run([sys.executable, "-m", "zeroshard.tools.cli", "env"], capture_output=True, text=True, check=True)
    assert "torch" in env.stdout and "backends" in env.stdout and "gloo" in env.stdout
    script = tmp_path / "hello.py"
    # one os.write per rank: the two ranks share the pipe, and print() may write in pieces
    script.write_text("import os\nos.write(1, f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}\\n\".encode())\n")
    run = subprocess.run([sys.executable, "-m", "zeroshard.tools.cli", "run", "--standalone", "--nproc_per_node", "2",
                          str(script)], capture_output=True, text=True, check=True, timeout=120)
    assert "rank 0 of 2" in run.stdout and "rank 1 of 2" in run.stdout


def test_plots(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "estimate.png"
    assert main(["estimate", "--params", "7e9", "--gpus-per-node", "8", "--plot", str(out)]) == 0
    assert out.stat().st_size > 1000 and out.read_bytes()[:4] == b"\x89PNG"
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("\n".join(json.dumps({"step": s, "loss": 3.0 / s, "tokens_per_s": 100.0 * s,
                                             "host_peak_mib": 400.0, "device_peak_mib": 0.0}) for s in (1, 2, 3)))
    assert main(["plot", str(metrics), "-o", str(tmp_path / "m.png")]) == 0
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()


def test_a_lora_job_has_gradients_and_optimizer_state_only_for_what_trains() -> None:
    from zeroshard.planning.estimator import EstimateRequest, estimate_stage

    full = EstimateRequest(7e9, 8)
    lora = EstimateRequest(7e9, 8, trainable=0.01)
    for stage in range(4):
        a, b = estimate_stage(full, stage), estimate_stage(lora, stage)
        assert b.params == a.params  # frozen parameters are held too: sharded at stage 3 only
        assert b.grads == pytest.approx(a.grads * 0.01) and b.optimizer == pytest.approx(a.optimizer * 0.01)
    assert estimate_stage(lora, 3).params == 2 * 7e9 / 8 and estimate_stage(lora, 2).params == 2 * 7e9


def test_a_pipeline_stage_holds_its_share_over_its_data_parallel_ranks() -> None:
    """Ψ/P over N/P ranks; the first stage's activations: min(P, m) micro-batches of ceil(L/P) layers under
    1F1B, all m under GPipe; bubble (P-1)/(m+P-1); m x b x s x h x 2 bytes each way per boundary."""
    from zeroshard.planning import model_state_bytes
    from zeroshard.planning.estimator import (PipelineShape, activation_bytes, estimate_stage, pipeline_p2p_bytes)

    req = EstimateRequest(8e9, 8, pipeline=PipelineShape(2), micro_steps=8)
    assert [estimate_stage(req, s).model_states for s in range(4)] == [64e9, 28e9, 22e9, 16e9]
    for stage in range(4):
        one = model_state_bytes(stage, 4e9, 4, "mixed")
        e = estimate_stage(req, stage)
        assert (e.params, e.grads, e.optimizer) == (one.params, one.grads, one.optimizer)
    shape = ModelShape(hidden=8, layers=4, heads=2)
    per_layer = 16 * 1 * 8 * (34 + 5 * 2 * 16 / 8)  # 6912 bytes
    assert per_layer == 6912
    base = EstimateRequest(8e9, 8, micro_batch=1, seq_len=16, shape=shape, micro_steps=8)
    one_f_one_b = dataclasses.replace(base, pipeline=PipelineShape(2))
    assert activation_bytes(base) == 4 * 6912  # no pipeline: one micro-batch of every layer
    assert activation_bytes(one_f_one_b) == 2 * 2 * 6912 == 27648  # 2 in flight x 2 layers
    assert activation_bytes(dataclasses.replace(one_f_one_b, micro_steps=1)) == 2 * 6912
    assert activation_bytes(dataclasses.replace(base, pipeline=PipelineShape(2, "gpipe"))) == 8 * 2 * 6912 == 110592
    assert activation_bytes(dataclasses.replace(one_f_one_b, checkpointing=True)) == 2 * (2 * 16 * 8) * 2 + 6912
    five = dataclasses.replace(one_f_one_b, shape=ModelShape(hidden=8, layers=5, heads=2))
    assert activation_bytes(five) == 2 * 3 * 6912  # the first stage's ceil(5/2) layers
    assert PipelineShape(4).bubble(8) == 3 / 11 and PipelineShape(2).bubble(1) == 0.5
    assert PipelineShape(4).in_flight(8) == 4 and PipelineShape(4).in_flight(8, stage_index=3) == 1
    assert pipeline_p2p_bytes(one_f_one_b) == 2 * 8 * 1 * 16 * 8 * 2 == 4096
    assert pipeline_p2p_bytes(dataclasses.replace(one_f_one_b, precision="fp32")) == 8192
    assert pipeline_p2p_bytes(base) is None and pipeline_p2p_bytes(EstimateRequest(8e9, 8, pipeline=PipelineShape(2))) \
        is None


def test_expert_state_is_sharded_over_the_ranks_holding_the_same_experts() -> None:
    """Ψ = 10000: Ψ_e = 4 experts x 1000 x 2 layers = 8000, Ψ_d = 2000; ep 2 over 4 ranks: a rank holds
    Ψ_d + Ψ_e/2 = 6000 parameters, the dense state sharded 4 ways, the experts' 2 ways."""
    from zeroshard.planning.estimator import MoEShape, estimate_stage

    moe = MoEShape(num_experts=4, expert_params=1000, moe_layers=2, ep_size=2)
    req = EstimateRequest(10000, 4, moe=moe)
    rows = [estimate_stage(req, s) for s in range(4)]
    assert [(e.params, e.grads, e.optimizer) for e in rows] == [
        (12000, 12000, 72000),  # stage 0: 2+2+12 bytes of 6000 parameters
        (12000, 12000, 12 * 2000 / 4 + 12 * 4000 / 2),  # 6000 + 24000
        (12000, 2 * 2000 / 4 + 2 * 4000 / 2, 30000),  # 1000 + 4000
        (5000, 5000, 30000)]
    # sharded categories hold Ψ_e/N of the experts' state whatever ep is; what ep saves is the whole copies
    dense = [estimate_stage(dataclasses.replace(req, moe=dataclasses.replace(moe, ep_size=ep)), 2) for ep in (1, 4)]
    assert [e.optimizer for e in dense] == [30000, 30000] and [e.params for e in dense] == [20000, 2 * (2000 + 2000)]
    # stage 3 shards the experts' parameters over the ranks holding them too
    assert [e.total for e in rows] == [96000, 54000, 47000 + rows[2].buffers, 40000 + rows[3].buffers]
    small = [dataclasses.replace(e, buffers=0.0) for e in rows]
    assert recommend(small, 45000 / GB / 0.9) == 3 and recommend(small, 50000 / GB / 0.9) == 2


def test_the_all_to_all_sends_four_times_its_share_of_the_dispatch_buffer() -> None:
    """4 x (P-1)/P x E x c x hidden x dtype bytes per MoE layer per micro-batch, c as the gate computes it."""
    from zeroshard.experts.gating import capacity_for
    from zeroshard.planning.estimator import MoEShape, all_to_all_bytes

    moe = MoEShape(num_experts=4, expert_params=1000, moe_layers=2, ep_size=2)
    req = EstimateRequest(10000, 4, micro_batch=2, seq_len=8, shape=ModelShape(hidden=8), moe=moe)
    assert moe.capacity(16) == 4  # ceil(16 / 4 x 1.0)
    assert all_to_all_bytes(req) == 4 * 1 * 4 * 4 * 8 * 2 / 2 == 512
    top2 = dataclasses.replace(moe, topk=2)
    assert top2.capacity(16) == 8 and all_to_all_bytes(dataclasses.replace(req, moe=top2)) == 1024
    wide = dataclasses.replace(moe, capacity_factor=1.5)
    assert wide.capacity(16) == 6 and all_to_all_bytes(dataclasses.replace(req, moe=wide)) == 768
    assert moe.capacity(4) == 4 and dataclasses.replace(moe, min_capacity=1).capacity(4) == 1  # min_capacity
    assert all_to_all_bytes(dataclasses.replace(req, precision="fp32")) == 1024
    ep4 = dataclasses.replace(moe, ep_size=4)
    assert all_to_all_bytes(dataclasses.replace(req, moe=ep4)) == 4 * 3 * 4 * 4 * 8 * 2 / 4 == 768
    assert all_to_all_bytes(dataclasses.replace(req, moe=dataclasses.replace(moe, ep_size=1))) == 0
    assert all_to_all_bytes(dataclasses.replace(req, seq_len=None)) is None
    for tokens, experts, k, factor in ((16, 4, 1, 1.0), (1000, 8, 2, 1.25), (3, 16, 1, 1.0), (4096, 64, 2, 1.0)):
        shape = MoEShape(experts, 1, 1, topk=k, capacity_factor=factor)
        assert shape.capacity(tokens) == capacity_for(tokens, experts, factor * (2 if k == 2 else 1), 4)


def test_cli_estimate_with_a_pipeline(tmp_path, capsys) -> None:
    assert main(["estimate", "--params", "8e9", "--gpus-per-node", "8", "--pp", "2", "--grad-accum", "8",
                 "--precision", "fp16", "--micro-batch", "1", "--seq-len", "16", "--hidden", "8", "--layers", "4",
                 "--heads", "2", "--gpu-memory", "40"]) == 0
    out = capsys.readouterr().out
    assert ("pipeline: 2 stages x 4 data-parallel ranks, 1f1b, 8 micro-batches per step; a stage holds 4e+09 "
            "parameters, ZeRO over its 4 ranks; rows: the first stage, activations of 2 micro-batches of 2 layers "
            "in flight") in out
    assert "| 0 | 8 | 8 | 48 | 64 | 2.765e-05 |" in out and "| 3 | 2 | 2 | 12 | 16 | 2.765e-05 |" in out
    assert "pipeline bubble: (P-1)/(m+P-1) = 11.1% of each step idle (2 stages, 8 micro-batches)" in out
    assert "between stages: 4.096e-06 GB per boundary per step (8 micro-batches x 1 x 16 x 8 x 2 bytes" in out
    assert "ZeRO stage 1 is the lowest that fits 40 GB" in out
    assert main(["estimate", "--params", "8e9", "--gpus-per-node", "8", "--pp", "2", "--schedule", "gpipe"]) == 0
    out = capsys.readouterr().out
    assert "gpipe" in out and "between stages: give --micro-batch, --seq-len and --hidden for the bytes" in out
    config = tmp_path / "ds.json"  # the config's pipeline section when --pp is not given
    config.write_text(json.dumps({"pipeline": {"stages": 4, "schedule": "gpipe"}, "gradient_accumulation_steps": 2}))
    assert main(["estimate", "--params", "8e9", "--gpus-per-node", "8", "--config", str(config)]) == 0
    assert "pipeline: 4 stages x 2 data-parallel ranks, gpipe, 2 micro-batches per step" in capsys.readouterr().out
    for bad, message in ((["--pp", "3"], "--pp 3 does not divide the 8 ranks"),
                         (["--pp", "0"], "--pp 0 does not divide the 8 ranks"),
                         (["--pp", "8", "--layers", "4"], "every stage needs a layer"),
                         (["--schedule", "gpipe"], "--schedule belongs to a pipeline"),
                         (["--pp", "2", "--intra-node-bw", "900GB/s", "--inter-node-bw", "50GB/s", "--tflops", "400",
                           "--micro-batch", "1", "--seq-len", "8"], "pipeline bytes need the micro batch, the "
                                                                    "sequence length and the hidden size")):
        with pytest.raises(SystemExit, match=message):
            main(["estimate", "--params", "8e9", "--gpus-per-node", "8", *bad])


def test_cli_estimate_with_experts(capsys) -> None:
    moe = ["--experts", "4", "--expert-params", "1000", "--moe-layers", "2"]
    assert main(["estimate", "--params", "10000", "--gpus-per-node", "4", "--ep", "2", *moe, "--micro-batch", "2",
                 "--seq-len", "8", "--hidden", "8", "--grad-accum", "3", "--precision", "fp16"]) == 0
    out = capsys.readouterr().out
    assert ("MoE: 2 layers x 4 experts x 1000 parameters = 8000 expert + 2000 dense, top-1, ep 2: a rank holds 2 of "
            "each layer's 4 experts, their state sharded over the 2 ranks holding them") in out
    assert "| 1 | 1.2e-05 | 1.2e-05 | 3e-05 |" in out and "| 3 | 5e-06 | 5e-06 | 3e-05 |" in out
    assert ("all-to-all: 5.12e-07 GB per MoE layer per micro-batch per rank (4 x 1/2 x 4 experts x capacity 4 x 8 x 2 "
            "bytes), 3.072e-06 GB per rank per step (2 layers x 3 micro-batches)") in out
    assert main(["estimate", "--params", "10000", "--gpus-per-node", "4", *moe[:4], "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 layers x 4 experts" in out and "all-to-all: none (--ep 1: every rank holds every expert)" in out
    for bad, message in ((["--ep", "3", *moe], "--ep 3 does not divide the 4 experts"),
                         (["--ep", "4", "--experts", "8", "--expert-params", "10", "--moe-layers", "1",
                           "--gpus-per-node", "2"], "--ep 4 does not divide the 2 data-parallel ranks"),
                         (["--topk", "3", *moe], "--topk 3: zeroshard's MoE routes each token to 1 or 2 experts"),
                         (["--topk", "0", *moe], "--topk 0"),
                         (["--ep", "2"], "--ep describe"),
                         (["--experts", "4", "--moe-layers", "2"], "--experts needs --expert-params"),
                         (["--experts", "4", "--expert-params", "10"], "--experts needs --moe-layers"),
                         (["--experts", "4", "--expert-params", "5000", "--moe-layers", "2"], "outnumber"),
                         (["--pp", "2", "--ep", "2", *moe], "expert parallelism inside a pipeline")):
        args = ["estimate", "--params", "10000", "--gpus-per-node", "4", *bad]
        if "--gpus-per-node" in bad[1:]:
            args = ["estimate", "--params", "10000", *bad]
        with pytest.raises(SystemExit, match=message):
            main(args)


def test_moe_layout_from_hugging_face_configs(tmp_path, capsys) -> None:
    """Mixtral / Qwen2-MoE / OLMoE configs give experts, the parameters of one, the MoE layers and top-k;
    E x that x layers is what the model's experts hold."""
    from zeroshard.planning.estimator import moe_from_hf_config

    assert moe_from_hf_config({"hidden_size": 8, "num_hidden_layers": 2, "intermediate_size": 16}) is None
    assert moe_from_hf_config({"hidden_size": 8, "num_hidden_layers": 6, "intermediate_size": 16,
                               "moe_intermediate_size": 4, "num_experts": 6, "num_experts_per_tok": 2,
                               "decoder_sparse_step": 2, "mlp_only_layers": [3]}) == {
        "num_experts": 6, "expert_params": 3 * 8 * 4, "moe_layers": 2, "topk": 2}  # layers 1 and 5
    transformers = pytest.importorskip("transformers")
    import torch

    common = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=2)
    for config in (transformers.MixtralConfig(**common, num_local_experts=4),
                   transformers.Qwen2MoeConfig(**common, num_experts=6, moe_intermediate_size=12,
                                               shared_expert_intermediate_size=20, mlp_only_layers=[1]),
                   transformers.OlmoeConfig(**common, num_experts=8)):
        moe = moe_from_hf_config(config.to_dict())
        assert moe is not None
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        assert moe["num_experts"] * moe["expert_params"] * moe["moe_layers"] == experts, type(config).__name__
    path = tmp_path / "config.json"
    path.write_text(json.dumps(transformers.MixtralConfig(**common, num_local_experts=4).to_dict()))
    assert main(["estimate", "--hf-config", str(path), "--gpus-per-node", "4", "--ep", "4"]) == 0
    assert "MoE: 4 layers x 4 experts x 1152 parameters = 1.843e+04 expert" in capsys.readouterr().out
    path.write_text(json.dumps(transformers.OlmoeConfig(**common, num_experts=8).to_dict()))
    with pytest.raises(SystemExit, match="routes each token to 8 experts"):
        main(["estimate", "--hf-config", str(path), "--gpus-per-node", "4", "--ep", "4"])
    assert main(["estimate", "--hf-config", str(path), "--gpus-per-node", "4", "--ep", "4", "--topk", "2"]) == 0
    capsys.readouterr()


def test_a_tensor_parallel_rank_holds_its_share_over_its_data_parallel_ranks() -> None:
    """Ψ = 10000 with X = 6000 split, T = 2 over 4 ranks: a rank holds X/T + (Ψ - X) = 7000 parameters,
    their state sharded over its 2 data-parallel ranks; the buffers are those of that engine."""
    from zeroshard.planning import model_state_bytes
    from zeroshard.planning.estimator import TensorShape, estimate_stage, tensor_rank_params

    req = EstimateRequest(10000, 4, tensor=TensorShape(2, split_params=6000))
    assert tensor_rank_params(req) == 7000
    rows = [estimate_stage(req, s) for s in range(4)]
    assert [(e.params, e.grads, e.optimizer) for e in rows] == [
        (14000, 14000, 84000), (14000, 14000, 42000), (14000, 7000, 42000), (7000, 7000, 42000)]
    for stage in range(4):
        one = model_state_bytes(stage, 7000, 2, "mixed")
        assert (rows[stage].params, rows[stage].grads, rows[stage].optimizer) == (one.params, one.grads, one.optimizer)
        assert rows[stage].buffers == estimate_stage(EstimateRequest(7000, 2), stage).buffers
    fp32 = estimate_stage(dataclasses.replace(req, precision="fp32"), 1)
    assert fp32.model_states == 8 * 7000 + 8 * 7000 / 2
    # nothing split: every rank holds the whole model, sharded over N/T; all split: Ψ/T over N/T
    assert estimate_stage(EstimateRequest(10000, 4, tensor=TensorShape(2, split_params=0)), 3).params == 2 * 10000 / 2
    assert estimate_stage(EstimateRequest(10000, 4, tensor=TensorShape(2, split_params=10000)), 3).params == 5000
    assert estimate_stage(EstimateRequest(10000, 4, tensor=TensorShape(1, split_params=6000)), 3).model_states == \
        estimate_stage(EstimateRequest(10000, 4), 3).model_states


def test_the_split_parameters_default_to_a_llama_decoders_linear_layers() -> None:
    """Per layer 2h^2 (q, o) + 2h x h_kv (k, v) + 3h x ffn (gate, up, down); ffn defaults to 4h, the
    key/value heads to the heads.  Against a Hugging Face Llama's own linear weights."""
    from zeroshard.planning.estimator import TensorShape

    shape = ModelShape(hidden=8, layers=2, heads=4)
    assert TensorShape(2, kv_heads=2, ffn=16).split(shape) == 2 * (2 * 64 + 2 * 8 * 4 + 3 * 8 * 16) == 1152
    assert TensorShape(2, ffn=16).split(shape) == 2 * (4 * 64 + 3 * 8 * 16) == 1280
    assert TensorShape(2).split(shape) == 2 * (4 * 64 + 3 * 8 * 32) == 2048
    assert TensorShape(2, split_params=7).split(ModelShape()) == 7 and TensorShape(2).split(ModelShape(hidden=8)) is None
    transformers = pytest.importorskip("transformers")
    import torch

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    linear = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    assert TensorShape(2, kv_heads=2, ffn=24).split(ModelShape(hidden=16, layers=3, heads=4)) == linear


def test_tensor_parallel_activations_split_the_intermediates_and_keep_the_inputs_whole() -> None:
    """s*b*h*(10 + 24/T + 5as/(hT)) per layer: s=16, b=1, h=8, a=2, T=2: 128 x (10 + 12 + 10) = 4096
    bytes (6912 without tensor parallelism); checkpointed, each layer's whole input plus one layer."""
    from zeroshard.planning.estimator import TensorShape, activation_bytes

    shape = ModelShape(hidden=8, layers=4, heads=2)
    dense = EstimateRequest(8e9, 8, micro_batch=1, seq_len=16, shape=shape)
    tp = dataclasses.replace(dense, tensor=TensorShape(2, split_params=1e9))
    assert activation_bytes(dense) == 4 * 6912 and activation_bytes(tp) == 4 * 4096 == 16384
    assert activation_bytes(dataclasses.replace(tp, checkpointing=True)) == 4 * 2 * 16 * 8 + 4096 == 5120
    assert activation_bytes(dataclasses.replace(tp, precision="fp32")) == 2 * 16384
    four = dataclasses.replace(tp, tensor=TensorShape(4, split_params=1e9))
    assert activation_bytes(four) == 4 * 128 * (10 + 6 + 5) == 10752
    assert activation_bytes(dataclasses.replace(tp, tensor=TensorShape(1, split_params=1e9))) == activation_bytes(dense)


def test_the_tensor_parallel_all_reduces_send_two_t_minus_one_over_t_of_each() -> None:
    """7 all-reduces of b x s x h per layer per micro-batch (o and down forward; q, k, v, gate and up
    backward, as torch's ColwiseParallel reduces each input gradient): 7 x 2 (T-1)/T x b s h x dtype."""
    from zeroshard.planning.estimator import TensorShape, tensor_parallel_bytes

    req = EstimateRequest(10000, 4, micro_batch=2, seq_len=8, shape=ModelShape(hidden=8),
                          tensor=TensorShape(2, split_params=6000))
    assert tensor_parallel_bytes(req) == 7 * 2 * 1 * 2 * 8 * 8 * 2 / 2 == 1792
    assert tensor_parallel_bytes(dataclasses.replace(req, precision="fp32")) == 3584
    assert tensor_parallel_bytes(dataclasses.replace(req, tensor=TensorShape(4, split_params=6000))) == \
        7 * 2 * 3 * 2 * 8 * 8 * 2 / 4 == 2688
    assert tensor_parallel_bytes(dataclasses.replace(req, tensor=TensorShape(1, split_params=6000))) == 0
    assert tensor_parallel_bytes(dataclasses.replace(req, seq_len=None)) is None
    assert tensor_parallel_bytes(dataclasses.replace(req, tensor=None)) is None


def test_tensor_parallel_layouts_zeroshard_does_not_train_are_refused() -> None:
    from zeroshard.planning.estimator import EstimateError, MoEShape, PipelineShape, TensorShape, check_parallel

    base = EstimateRequest(10000, 4, tensor=TensorShape(2, split_params=6000))
    check_parallel(base)
    check_parallel(dataclasses.replace(base, shape=ModelShape(heads=4), tensor=TensorShape(2, 6000, kv_heads=2)))
    check_parallel(dataclasses.replace(base, pipeline=PipelineShape(2)))  # 2 x 1 x 2: estimated, as a plan
    for bad, message in (
            (dataclasses.replace(base, tensor=TensorShape(3, 6000)), "--tp 3 does not divide the 4 ranks"),
            (dataclasses.replace(base, tensor=TensorShape(0, 6000)), "--tp 0 does not divide the 4 ranks"),
            (dataclasses.replace(base, shape=ModelShape(heads=6), tensor=TensorShape(4, 6000)),
             "--tp 4 does not divide the 6 attention heads"),
            (dataclasses.replace(base, tensor=TensorShape(2, 6000, kv_heads=1)),
             "--tp 2 does not divide the 1 key/value heads"),
            (dataclasses.replace(base, pipeline=PipelineShape(4)), "--pp 4 does not divide the 2 ranks left by "
                                                                   "--tp 2"),
            (dataclasses.replace(base, moe=MoEShape(4, 100, 2, ep_size=2)), "--tp 2 with --ep 2"),
            (dataclasses.replace(base, moe=MoEShape(4, 100, 2)), "--tp 2 with --experts"),
            (dataclasses.replace(base, tensor=TensorShape(2)), "--tp 2 needs the split parameters"),
            (dataclasses.replace(base, tensor=TensorShape(2, 20000)), "2e\\+04 split parameters")):
        with pytest.raises(EstimateError, match=message):
            check_parallel(bad)


def test_cli_estimate_with_tensor_parallelism(tmp_path, capsys) -> None:
    assert main(["estimate", "--params", "10000", "--gpus-per-node", "4", "--tp", "2", "--tp-params", "6000",
                 "--micro-batch", "2", "--seq-len", "8", "--hidden", "8", "--layers", "2", "--heads", "2",
                 "--grad-accum", "3", "--precision", "fp16"]) == 0
    out = capsys.readouterr().out
    assert ("tensor parallel: 2 tensor-parallel x 2 data-parallel ranks; 6000 of the 1e+04 parameters split "
            "(--tp-params), the rest whole: a rank holds X/T + (Ψ - X) = 7000 parameters, ZeRO over its 2 "
            "data-parallel ranks") in out
    assert "activations: s*b*h*(10 + 24/T + 5*a*s/(h*T)) per layer (T = 2" in out
    # 2 layers x 8 x 2 x 8 x (10 + 12 + 5 x 2 x 8 / 16) = 6912 bytes of activations
    assert "| 0 | 1.4e-05 | 1.4e-05 | 8.4e-05 | 0.000112 | 6.912e-06 |" in out
    assert "| 3 | 7e-06 | 7e-06 | 4.2e-05 | 5.6e-05 | 6.912e-06 |" in out
    assert ("tensor-parallel all-reduce: 1.792e-06 GB per layer per micro-batch per rank (7 all-reduces, 2 forward + "
            "5 backward, x 2 x 1/2 x 2 x 8 x 8 x 2 bytes), 1.075e-05 GB per rank per step (2 layers x 3 "
            "micro-batches)") in out
    # the split counted from the shape; --tp 1 sends nothing
    assert main(["estimate", "--params", "1e9", "--gpus-per-node", "4", "--tp", "1", "--hidden", "8", "--layers",
                 "2", "--heads", "4", "--kv-heads", "2", "--ffn", "16"]) == 0
    out = capsys.readouterr().out
    assert "1152 of the 1e+09 parameters split (2 layers x (2h^2 + 2h^2 x 2/4 kv heads + 3h x ffn), h 8, ffn 16" in out
    assert "tensor-parallel all-reduce: none (--tp 1)" in out
    config = tmp_path / "ds.json"  # the config's autotp_size when --tp is not given
    config.write_text(json.dumps({"tensor_parallel": {"autotp_size": 4}}))
    assert main(["estimate", "--params", "1e9", "--gpus-per-node", "8", "--config", str(config), "--tp-params",
                 "8e8"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel: 4 tensor-parallel x 2 data-parallel ranks" in out and "= 4e+08 parameters" in out
    assert "tensor-parallel all-reduce: give --micro-batch, --seq-len and --hidden for the bytes" in out
    transformers = pytest.importorskip("transformers")  # GQA and the MLP width from a Hugging Face config
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    assert main(["estimate", "--hf-config", str(tmp_path), "--gpus-per-node", "2", "--tp", "2"]) == 0
    assert "3 layers x (2h^2 + 2h^2 x 2/4 kv heads + 3h x ffn), h 16, ffn 24" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="does not divide the 2 key/value heads"):
        main(["estimate", "--hf-config", str(tmp_path), "--gpus-per-node", "4", "--tp", "4"])
    for bad, message in ((["--tp", "3"], "--tp 3 does not divide the 8 ranks"),
                         (["--tp", "2", "--heads", "3", "--tp-params", "10"], "does not divide the 3 attention heads"),
                         (["--tp", "2", "--pp", "8", "--tp-params", "10"], "--pp 8 does not divide the 4 ranks left"),
                         (["--tp", "2", "--tp-params", "10", "--experts", "4", "--expert-params", "10",
                           "--moe-layers", "1", "--ep", "2"], "tensor parallelism with expert parallelism"),
                         (["--tp", "2"], "--tp 2 needs the split parameters"),
                         (["--kv-heads", "2", "--ffn", "16"], "--kv-heads, --ffn belong"),
                         (["--tp", "2", "--tp-params", "10", "--intra-node-bw", "900GB/s", "--inter-node-bw", "50GB/s",
                           "--tflops", "400", "--micro-batch", "1", "--seq-len", "8"],
                          "tensor-parallel bytes need the micro batch, the sequence length and the hidden size"),
                         (["--experts", "4", "--expert-params", "10", "--moe-layers", "1", "--intra-node-bw", "900GB/s",
                           "--inter-node-bw", "50GB/s", "--tflops", "400", "--micro-batch", "1", "--seq-len", "8"],
                          "the scale model does not know experts")):
        with pytest.raises(SystemExit, match=message):
            main(["estimate", "--params", "8e9", "--gpus-per-node", "8", *bad])


def test_a_tensor_parallel_rank_of_a_pipeline_holds_its_stages_share() -> None:
    """Ψ = 10000 with X = 6000 split, T = 2, P = 2 over 8 ranks: a rank holds (X/T + Ψ - X)/P = 3500
    parameters, ZeRO over its 8/(2 x 2) = 2 data-parallel ranks; activations of ceil(4/2) = 2 layers for
    min(P, m) = 2 micro-batches, with the tensor-parallel formula."""
    from zeroshard.planning import model_state_bytes
    from zeroshard.planning.estimator import (PipelineShape, TensorShape, data_parallel_size, estimate_stage,
                                              state_parts)

    req = EstimateRequest(10000, 8, micro_batch=2, seq_len=8, shape=ModelShape(hidden=8, layers=4, heads=2),
                          micro_steps=3, tensor=TensorShape(2, split_params=6000), pipeline=PipelineShape(2))
    assert state_parts(req) == [(3500, 2)] and data_parallel_size(req) == 2
    for stage in range(4):
        one = model_state_bytes(stage, 3500, 2, "mixed")
        assert estimate_stage(req, stage).model_states == one.params + one.grads + one.optimizer
    # per layer 8 x 2 x 8 x (10 + 24/2 + 5 x 2 x 8 / (8 x 2)) = 3456 bytes; 2 layers x 2 micro-batches in flight
    assert estimate_stage(req, 0).activations == 2 * 2 * 3456


def test_cli_estimate_with_tensor_parallelism_inside_a_pipeline(capsys) -> None:
    assert main(["estimate", "--params", "10000", "--nodes", "2", "--gpus-per-node", "4", "--tp", "2", "--pp", "2",
                 "--tp-params", "6000", "--micro-batch", "2", "--seq-len", "8", "--hidden", "8", "--layers", "4",
                 "--heads", "2", "--grad-accum", "3", "--precision", "fp16"]) == 0
    out = capsys.readouterr().out
    assert "pipeline: 2 stages x 2 data-parallel ranks, 1f1b, 3 micro-batches per step" in out
    assert ("a rank holds X/T + (Ψ - X) = 7000 parameters, 3500 of them in a stage of the pipeline, ZeRO over its 2 "
            "data-parallel ranks") in out
    # stage 3: 16 x 3500 / 2 = 28000 bytes of model states
    assert "| 3 | 3.5e-06 | 3.5e-06 | 2.1e-05 | 2.8e-05 | 1.382e-05 |" in out
    assert "pipeline bubble: (P-1)/(m+P-1) = 25.0% of each step idle (2 stages, 3 micro-batches)" in out
    # a stage's 2 layers, not the model's 4: 1792 x 2 x 3 = 10752 bytes
    assert "1.075e-05 GB per rank per step (2 layers of a stage x 3 micro-batches)" in out


def test_pipeline_shape_follows_each_schedules_own_order() -> None:
    from zeroshard.planning.estimator import PipelineShape

    assert PipelineShape(4, "1f1b").in_flight(8) == 4 and PipelineShape(4, "gpipe").in_flight(8) == 8
    interleaved = PipelineShape(4, "interleaved_1f1b", chunks=2)
    # the first stage's warm-up: (v-1)p + 2(p-1) = 10 chunk forwards, then one more before its first
    # backward: 11 chunks of half a stage's layers
    assert interleaved.in_flight(8) == 5.5
    assert interleaved.bubble(8) == pytest.approx(3 / 19) and PipelineShape(4).bubble(8) == pytest.approx(3 / 11)


def test_fp8_halves_the_gathered_bytes_and_adds_one_gathers_packed_chunks(capsys) -> None:
    """``--fp8``: stage 3's buffers grow by one gather's packed FP8 chunks ((N+1)/N bytes per element of a
    prefetched unit), the model states do not change, and the line on the bytes halves bf16's."""
    from zeroshard.planning import EstimateRequest, estimate_all
    plain, fp8 = (estimate_all(EstimateRequest(num_params=7e9, world_size=8, fp8=on)) for on in (False, True))
    assert [e.model_states for e in plain] == [e.model_states for e in fp8]
    assert fp8[3].buffers - plain[3].buffers == pytest.approx(5e7 * 9 / 8)
    assert [e.buffers for e in plain[:3]] == [e.buffers for e in fp8[:3]]
    assert main(["estimate", "--params", "7e9", "--gpus-per-node", "8", "--fp8"]) == 0
    assert "6.125 GB received per rank per pass over the model were every parameter such a weight" in \
        capsys.readouterr().out
