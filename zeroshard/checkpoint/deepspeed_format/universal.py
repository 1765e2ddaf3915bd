"""DeepSpeed's universal checkpoint: one folder per parameter, written from a DeepSpeed checkpoint
(``ds_to_universal``) and read back whole.

[Note: DeepSpeed's universal layout]
``ds_to_universal`` turns one DeepSpeed checkpoint into a folder that loads at any world size: under
``<output>/zero/``, one folder per trained parameter, named by its state-dict name, with ``fp32.pt``,
``exp_avg.pt`` and ``exp_avg_sq.pt``; at stages 1-2 each a dict ``{"cat_dim": 0, "param": <the whole
tensor in its shape>}`` and a ``step.pt`` (its group's Adam step), at stage 3 the bare flat tensor
(its ``numel`` elements) and no step.  At stages 1-2 the model file's other entries (buffers, frozen
parameters) get a ``fp32.pt`` of ``{"param": <the tensor in fp32>}`` too.  ``zero/optimizer_state.pt``
holds the data-parallel rank 0 optimizer file's scalars: at stages 1-2 its entries but the sharded
ones (``base_optimizer_state``, ``param_slice_mappings``, ``single_partition_of_fp32_groups``), with the
optimizer's ``param_groups``; at stage 3 all of it, ``param_groups`` added.  The model files are copied
beside ``zero/``, and ``latest_universal``, beside the output folder, names it.  zeroshard writes the
same files from the partitions merged as it reads them (partitions.py), its pickles naming only
DeepSpeed's own classes, and reads such a folder as one more DeepSpeed checkpoint: every parameter and
moment whole, the step from the step files (stages 1-2) or the optimizer state (stage 3).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from ..format import CheckpointError
from .pickler import save_deepspeed_file
from .reader import DeepSpeedReader, optimizer_file
from .universal_read import LATEST_UNIVERSAL, OPTIMIZER_STATE_FILE, STATE_FILES, ZERO_FOLDER
from .unpickle import load_deepspeed_file

_SHARDED = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")


def _rank0_optimizer(reader: DeepSpeedReader) -> dict[str, Any]:
    file: dict[str, Any] = load_deepspeed_file(reader.directory / optimizer_file(0, reader.bf16))
    return file["optimizer_state_dict"]


def common_optimizer_state(optimizer: dict[str, Any], stage: int) -> dict[str, Any]:
    """``zero/optimizer_state.pt`` from data-parallel rank 0's ``optimizer_state_dict``: its entries but
    the sharded ones, with the optimizer's ``param_groups``."""
    if stage == 3:
        return {**optimizer, "param_groups": optimizer["optimizer_state_dict"]["param_groups"]}
    out = {k: v for k, v in optimizer.items() if k not in _SHARDED}
    out["param_groups"] = optimizer["base_optimizer_state"]["param_groups"]
    return out


def write_universal(checkpoint: Path, output_folder: Path) -> Path:
    """``ds_to_universal``: the DeepSpeed checkpoint directory ``checkpoint`` (one tag's) as the universal
    folder ``output_folder`` (see [Note: DeepSpeed's universal layout]).  Returns ``output_folder``."""
    output_folder = Path(output_folder)
    with DeepSpeedReader(Path(checkpoint)) as reader:
        if reader.stage == 0:
            raise CheckpointError(f"{checkpoint}: a checkpoint without ZeRO has no partitions to convert (DeepSpeed's "
                                  f"universal checkpoints are made from ZeRO stages 1-3)")
        zero = output_folder / ZERO_FOLDER
        zero.mkdir(parents=True, exist_ok=True)
        for name in reader.param_names():
            folder = zero / name
            folder.mkdir(exist_ok=True)
            for key, file in STATE_FILES.items():
                flat = reader.read(name, key if key == "param" else f"optim.{key}").clone()
                value = flat if reader.stage == 3 else {"cat_dim": 0, "param": flat.view(reader.shape(name))}
                save_deepspeed_file(value, folder / f"{file}.pt")
            if reader.stage < 3:
                step = reader.scalar_state(reader.bucket_of(name)).get("step")
                if step is not None:
                    save_deepspeed_file(step.clone(), folder / "step.pt")
        if reader.stage < 3:
            for name, tensor in (reader.model.get("module") or {}).items():
                if not (zero / name / "fp32.pt").is_file():
                    (zero / name).mkdir(exist_ok=True)
                    save_deepspeed_file({"param": tensor.float()}, zero / name / "fp32.pt")
        save_deepspeed_file(common_optimizer_state(_rank0_optimizer(reader), reader.stage), zero / OPTIMIZER_STATE_FILE)
        for model_file in sorted(reader.directory.glob("*model_states.pt")):
            shutil.copy2(model_file, output_folder)
    (output_folder.parent / LATEST_UNIVERSAL).write_text(output_folder.name)
    return output_folder
