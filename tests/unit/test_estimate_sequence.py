"""``zeroshard estimate --sp``: a sequence-parallel rank's activations and exchange bytes ([Note: sequence
parallel estimates] in zeroshard/planning/estimator.py).  The distributed family
(tests/distributed/test_sequence_parallel.py) checks the exchange bytes against the engine's ledger."""

from __future__ import annotations

import json

import pytest

from zeroshard.planning.estimator import (EstimateError, EstimateRequest, ModelShape, SequenceShape, activation_bytes,
                                          check_parallel, estimate_all, sequence_exchange_bytes)
from zeroshard.tools.cli import main

S, B, H, LAYERS, HEADS = 16384, 1, 2048, 16, 32


def request(sp: int = 1, mode: str = "ulysses", kv_heads: int = HEADS, **extra) -> EstimateRequest:
    return EstimateRequest(num_params=1.2e9, world_size=4, micro_batch=B, seq_len=S,
                           shape=ModelShape(hidden=H, layers=LAYERS, heads=HEADS),
                           sequence=SequenceShape(sp, mode, kv_heads) if sp > 1 else None, **extra)


def test_ulysses_splits_every_position_wise_activation_and_the_scores_by_the_degree() -> None:
    whole = activation_bytes(request())
    assert whole == LAYERS * S * B * H * (34 + 5 * HEADS * S / H)
    for sp in (2, 4):
        assert activation_bytes(request(sp)) == pytest.approx(whole / sp)
    # checkpointed: each layer's input slice, plus one layer recomputing
    assert activation_bytes(request(2, checkpointing=True)) == pytest.approx(
        LAYERS * 2 * S / 2 * B * H + S / 2 * B * H * (34 + 5 * HEADS * S / H))


def test_the_ring_keeps_no_scores_but_one_blocks() -> None:
    got = activation_bytes(request(4, "ring"))
    assert got == pytest.approx(LAYERS * S / 4 * B * H * 34 + 5 * HEADS * (S / 4) ** 2 * B)
    assert got < activation_bytes(request(4))


def test_model_states_do_not_change_with_the_sequence_split() -> None:
    """The sequence ranks are ZeRO ranks: the states are the data-parallel ones over the whole world."""
    plain, split = estimate_all(request()), estimate_all(request(2))
    assert [e.model_states for e in plain] == [e.model_states for e in split]


def test_exchange_bytes_follow_each_modes_messages() -> None:
    local = B * S / 2 * 2  # a rank's slice, 16-bit
    # Ulysses at P = 2: query, key, value and context, half of each sent, forward and backward
    assert sequence_exchange_bytes(request(2)) == 2 * 1 / 2 * local * 4 * H
    kv = H * 8 / HEADS  # grouped-query attention: 8 key/value heads travel
    assert sequence_exchange_bytes(request(2, kv_heads=8)) == 2 * 1 / 2 * local * (2 * H + 2 * kv)
    # fewer key/value heads than ranks are repeated to one per rank before the exchange
    assert sequence_exchange_bytes(request(4, kv_heads=2)) == pytest.approx(
        2 * 3 / 4 * B * S / 4 * 2 * (2 * H + 2 * H * 4 / HEADS))
    # the ring: (3P - 2) key/value blocks
    assert sequence_exchange_bytes(request(2, "ring", kv_heads=8)) == 4 * local * 2 * kv
    assert sequence_exchange_bytes(request()) is None


@pytest.mark.parametrize("sp, mode, extra, message", [
    (3, "ulysses", {}, "--sp 3 does not divide the 4 ranks"),
    (2, "ulysses", {"seq_len": 15}, "does not divide --seq-len 15"),
    (2, "ulysses", {"shape": ModelShape(hidden=H, layers=LAYERS, heads=3)}, "does not divide the 3 attention heads"),
    (4, "ulysses", {"shape": ModelShape(hidden=H, layers=LAYERS, heads=12)}, "with 6 key/value heads"),
    (2, "spiral", {}, "--sp-mode 'spiral'"),
])
def test_layouts_zeroshard_does_not_train_are_refused(sp, mode, extra, message) -> None:
    kv = 6 if "heads=12" in repr(extra) else None
    req = EstimateRequest(**{**dict(num_params=1e9, world_size=4, micro_batch=B, seq_len=S,
                                    shape=ModelShape(hidden=H, layers=LAYERS, heads=HEADS),
                                    sequence=SequenceShape(sp, mode, kv)), **extra})
    with pytest.raises(EstimateError, match=message.replace("(", r"\(")):
        check_parallel(req)


def test_the_ring_takes_any_head_count() -> None:
    check_parallel(EstimateRequest(num_params=1e9, world_size=4, seq_len=S,
                                   shape=ModelShape(hidden=H, layers=LAYERS, heads=3), sequence=SequenceShape(4, "ring")))


def test_cli_estimate_with_sequence_parallelism(tmp_path, capsys) -> None:
    flags = ["estimate", "--params", "1.2e9", "--gpus-per-node", "2", "--micro-batch", "1", "--seq-len", str(S),
             "--hidden", str(H), "--layers", str(LAYERS), "--heads", str(HEADS), "--kv-heads", "8"]
    assert main([*flags, "--sp", "2"]) == 0
    out = capsys.readouterr().out
    assert "sequence parallel (ulysses): 1 data-parallel x 2 sequence-parallel ranks" in out
    assert "sequence all-to-all: 0.08389 GB per attention layer per micro-batch per rank" in out
    assert main([*flags, "--sp", "2", "--sp-mode", "ring"]) == 0
    assert "sequence ring send/recv: 0.06711 GB per attention layer" in capsys.readouterr().out
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"sequence_parallel_size": 2, "sequence_parallel": {"mode": "ring"}}))
    assert main([*flags, "--config", str(config)]) == 0
    assert "sequence parallel (ring)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--sp-mode belongs to sequence parallelism"):
        main([*flags[:-2], "--sp-mode", "ring"])
    with pytest.raises(SystemExit, match="--sp 2 with --tp: zeroshard does not run sequence parallelism"):
        main([*flags, "--sp", "2", "--tp", "2", "--gpus-per-node", "4"])


def test_flash_attention_holds_no_scores() -> None:
    """``--flash-attention``: the s x s scores' term drops out, with or without the sequence split."""
    flash = dict(flash_attention=True)
    assert activation_bytes(request(**flash)) == LAYERS * S * B * H * 34
    assert activation_bytes(request(2, **flash)) == pytest.approx(LAYERS * S / 2 * B * H * 34)
    assert activation_bytes(request(2, "ring", **flash)) == activation_bytes(request(2, "ring"))  # the ring's own math
