"""The ``checkpoint`` block: loading, the files' writer, periodic saves, automatic resume and the layout
written; declared apart from schema.py's other blocks, which it re-exports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from .fields import key, non_negative, positive

__all__ = ["CheckpointConfig", "CheckpointWriterConfig"]


@dataclass(frozen=True)
class CheckpointWriterConfig:
    """``checkpoint.writer``: how checkpoint files are written (DeepSpeed's checkpoint-writer block)."""

    decoupled: bool = key(
        False, "DeepSpeed's key for decoupled checkpointing: every `save_checkpoint` is asynchronous (as "
        "`async_save=True`; a call's own `async_save=` decides for that call): training goes on while a background "
        "thread copies each rank's state to host memory (the next optimizer step waits for the copy), writes and "
        "publishes it; the next save, a load or `close()` waits for it, and raises its error on every rank if it "
        "failed.")
    type: Literal["python", "fast"] = key(
        "fast", "`\"fast\"`: checkpoint files are written around the page cache (`O_DIRECT` through an aligned "
        "buffer of `io_buffer_size` bytes; buffered where the file system refuses it); `\"python\"`: through it. "
        "As in DeepSpeed, a `writer` block defaults to `\"fast\"` and no `writer` block means `\"python\"`. "
        "DeepSpeed's `\"mock\"` (writes nothing) is refused.",
        default_text="`\"python\"` (`\"fast\"` in a `writer` block)")
    io_buffer_size: int = key(
        64 * 2**20, "Bytes handed to the file system per write call when a checkpoint file is written (`\"fast\"`: "
        "the aligned buffer's size).", positive)
    spread_over_steps: int = key(
        1, "zeroshard's own key: an asynchronous save writes at most 1/N of its bytes per optimizer step, sharing "
        "its cost between the N steps it overlaps; published within N steps, at once when something waits for it "
        "(the next save, a load, `wait_for_checkpoint()`, `close()`). 1: as fast as it goes.", positive)


@dataclass(frozen=True)
class CheckpointConfig:
    """``checkpoint``: how checkpoints are loaded, and zeroshard's periodic saves and automatic resume."""

    load_universal: bool = key(
        False, "Accepted with either value: every zeroshard checkpoint loads at any world size and stage, as a "
        "universal one does.")
    use_node_local_storage: bool = key(
        False, "No shared file system: every rank writes its file into its own node's `save_dir`, each node's local "
        "rank 0 writes the manifest (the same bytes on every node, listing every rank's file) and publishes "
        "`latest` there. Such a checkpoint loads with the same world size, ranks per node, stage and buckets, each "
        "rank reading only its node's files; to reshard or consolidate it, copy every node's files into one "
        "directory. Stages 1-3.")
    tag_validation: Literal["Ignore", "Warn", "Fail"] = key(
        "Warn", "What `save_checkpoint` does when ranks pass different tags (any case, as DeepSpeed): `Fail` raises "
        "`DivergenceError` on every rank before anything is written; `Warn` logs the tags on every rank and saves "
        "under rank 0's tag; `Ignore` saves under rank 0's tag silently. Either way the ranks' files land in one "
        "directory, so the checkpoint stays whole.")
    save_dir: Optional[str] = key(
        None, "zeroshard's own key: the directory of periodic saves (`save_interval`) and of `auto_resume`.")
    save_interval: int = key(
        0, "zeroshard's own key: every rank saves a checkpoint (`global_step<N>`) into `save_dir` every N optimizer "
        "steps; 0: never.", non_negative)
    keep_last: int = key(
        0, "zeroshard's own key: after each periodic save rank 0 removes all but the newest N periodic checkpoints "
        "(never the one `latest` names, never tags a script saved itself); 0 keeps all.", non_negative)
    auto_resume: bool = key(
        False, "zeroshard's own key: `initialize()` loads `save_dir`'s latest checkpoint when there is one, RNG "
        "included (`initialize(resume_from=...)` does the same for any directory): a job restarted by torchrun "
        "carries on where it was.")
    writer: CheckpointWriterConfig = key(CheckpointWriterConfig(type="python"), "How checkpoint files are written.")
    format: Literal["zeroshard", "deepspeed"] = key(
        "zeroshard", "zeroshard's own key: the layout `save_checkpoint` writes. `deepspeed`: DeepSpeed 0.19's files "
        "(`latest`, the model and ZeRO optimizer files of this world size and stage), which DeepSpeed's "
        "`load_checkpoint` and `zero_to_fp32.py` read; written synchronously, ZeRO stages 1-3, fp32 or bf16, one "
        "data-parallel group (`save_checkpoint(..., format=...)` chooses per save).")
