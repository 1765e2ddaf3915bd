"""`zeroshard estimate`, `env` and `run`: the seeds' 7B table to the digit, and every flag."""

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
