"""What the self-test expects a rank to hold: the ZeRO formulas for model states, and an estimate of
the device's peak for the step (model states, activations, buffers and the logits).

[Note: the device-peak bound]
The model-state check is exact: summed over the ranks, the measured bytes equal N times the formula
(see [Note: what the breakdown counts] in planning/accounting.py).  A peak cannot be: it holds
whatever the step allocates for a moment (the fp32 loss over the logits and its gradient, the
optimizer's scratch, the allocator's rounding), and the activation term is the Korthikanti estimate
of ``zeroshard estimate`` ([Note: the activation estimate] in planning/estimator.py), which an
attention that never materialises the scores undercuts.  So the peak is checked against a loose
bound, ``PEAK_SLACK`` times the estimate plus ``PEAK_FIXED_BYTES``: it catches a stage that holds
what it should have sharded or released (a whole model's worth of gradients or parameters is several
times the slack at the sizes ``--size`` offers), not a few percent.
"""

from __future__ import annotations

from ...planning import EstimateRequest, ModelShape, model_state_bytes
from ...planning.estimator import estimate_stage
from ...precision.policy import DTYPES, default_grad_accum
from ..demo.model import GPTConfig

PEAK_SLACK = 1.5
PEAK_FIXED_BYTES = 512 * 2**20


def grad_bytes(precision: str, accumulation: int) -> int | None:
    """Bytes per held gradient element: bf16 accumulating over several micro steps holds fp32 (the
    engine's default, ``precision/policy.py``); None: the precision's own."""
    if precision == "fp32":
        return None
    return DTYPES[default_grad_accum(precision, precision, accumulation)].itemsize


def model_state_formula(stage: int, num_params: int, world_size: int, precision: str, accumulation: int) -> float:
    """Per-rank model-state bytes by the ZeRO formula (``planning/accounting.py``)."""
    return model_state_bytes(stage, num_params, world_size, "fp32" if precision == "fp32" else "mixed",
                             grad_bytes(precision, accumulation)).total


def logits_bytes(model: GPTConfig, micro_batch: int) -> float:
    """The logits in the compute dtype or fp32, their fp32 copy for the loss, and its gradient: three
    fp32-sized tensors of micro batch x sequence x vocabulary."""
    return 3.0 * 4 * micro_batch * model.seq_len * model.vocab_size


def device_estimate(stage: int, num_params: int, world_size: int, precision: str, model: GPTConfig,
                    micro_batch: int, reduce_bucket_size: float, prefetch_bucket_size: float) -> float:
    """The step's expected device bytes: ``zeroshard estimate``'s total plus the logits."""
    mixed = precision != "fp32"
    request = EstimateRequest(num_params=num_params, world_size=world_size, precision="mixed" if mixed else "fp32",
                              micro_batch=micro_batch, seq_len=model.seq_len,
                              shape=ModelShape(model.d_model, model.n_layer, model.n_head),
                              reduce_bucket_size=reduce_bucket_size, prefetch_bucket_size=prefetch_bucket_size,
                              grad_bytes=grad_bytes(precision, 1))
    return estimate_stage(request, stage).total + logits_bytes(model, micro_batch)


def peak_bound(estimate: float) -> float:
    """The most a step's device peak may reach (see [Note: the device-peak bound])."""
    return PEAK_SLACK * estimate + PEAK_FIXED_BYTES
