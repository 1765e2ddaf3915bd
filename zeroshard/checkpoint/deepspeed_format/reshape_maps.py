"""DeepSpeed's Megatron-style reshape maps: which saved ranks' files a rank of a smaller pipeline x tensor x
data layout reads (``deepspeed.checkpoint``'s ``model_3d_desc``, ``meg_2d_parallel_map``,
``reshape_meg_2d_parallel``).

[Note: the 3D reshape maps]
A DeepSpeed checkpoint of a pipeline degree P, tensor degree T and data degree D holds P x T model files,
numbered pipeline-major (file ``i`` is stage ``i // T``, tensor rank ``i % T``), and D x P x T ZeRO files,
numbered data-major (file ``d * P * T + i``).  A layout can only shrink along each axis (each degree a
divisor of the saved one): a target rank then reads whole source files, never pieces of one.  The
tensor axis is contracted first: within each stage the T source ranks, in order, are cut into
contiguous runs, one per target tensor rank; then the pipeline axis: for each target tensor rank, the
stages' lists, in stage order, are cut into contiguous runs, one per target stage.  That gives a 2D map
of model files; the data axis then names, for each model file of a cell, its D ZeRO files (file ``i``
of every data rank, data rank by data rank), and those lists are cut into one contiguous run per
target data rank.  Contiguous runs keep each merged tensor in the order its pieces were saved.  Where
the data degree shrinks to one, a rank reads every saved rank's files of its cell; where a model axis
contracts and the data degree does not, each target data rank reads whole model files' data-rank sets
(the first target data rank the first files of the cell, and so on), not one saved data rank's files of
several model files.  These are DeepSpeed's maps, which its conversion tools and their users assume, so
they are kept exactly.
"""

from __future__ import annotations

from typing import Sequence, TypeVar

__all__ = ["partition_data", "meg_2d_parallel_map", "reshape_meg_2d_parallel", "model_3d_desc"]

T = TypeVar("T")
PP_DIM, TP_DIM, DP_DIM = "PP", "TP", "DP"


def partition_data(items: Sequence[T], num_partitions: int) -> list[list[T]]:
    """``items`` cut into ``num_partitions`` contiguous runs of equal length (a ValueError otherwise)."""
    if num_partitions < 1 or len(items) % num_partitions:
        raise ValueError(f"{len(items)} items do not split into {num_partitions} equal runs")
    size = len(items) // num_partitions
    return [list(items[k * size:(k + 1) * size]) for k in range(num_partitions)]


class meg_2d_parallel_map:  # noqa: N801 - DeepSpeed's name
    """A list of file indices per (pipeline index, tensor index) cell."""

    def __init__(self, pp_degree: int, tp_degree: int) -> None:
        self.pp_degree = pp_degree
        self.tp_degree = tp_degree
        self.map: dict[str, list[int]] = {}

    def simple_init(self) -> None:
        """Each cell holds its own model file's index (pipeline-major numbering)."""
        self.map = {self._make_key(*divmod(i, self.tp_degree)): [i] for i in range(self.pp_degree * self.tp_degree)}

    def add_data(self, pp_index: int, tp_index: int, data: list[int]) -> None:
        self._validate_indices(pp_index, tp_index)
        if not isinstance(data, list):
            raise TypeError(f"a cell's data is a list of indices, not {type(data).__name__}")
        self.map.setdefault(self._make_key(pp_index, tp_index), []).extend(data)

    def get_data(self, pp_index: int | None = None, tp_index: int | None = None) -> list[int]:
        """The indices of one cell, or of every cell along an axis left as None (pipeline-major)."""
        self._validate_indices(pp_index, tp_index)
        pps = range(self.pp_degree) if pp_index is None else [pp_index]
        tps = range(self.tp_degree) if tp_index is None else [tp_index]
        return [index for i in pps for j in tps for index in self.map.get(self._make_key(i, j), [])]

    def print_data(self, tag: str) -> None:
        print(tag)
        for key, value in self.map.items():
            print(f"{key} = {value}")

    def _validate_indices(self, pp_index: int | None, tp_index: int | None) -> None:
        if pp_index is not None and not 0 <= pp_index < self.pp_degree:
            raise IndexError(f"pipeline index {pp_index} outside degree {self.pp_degree}")
        if tp_index is not None and not 0 <= tp_index < self.tp_degree:
            raise IndexError(f"tensor index {tp_index} outside degree {self.tp_degree}")

    @staticmethod
    def _make_key(pp_index: int, tp_index: int) -> str:
        return f"{pp_index},{tp_index}"


def _contract_tensor_axis(source: meg_2d_parallel_map, tp_degree: int) -> meg_2d_parallel_map:
    target = meg_2d_parallel_map(source.pp_degree, tp_degree)
    for i in range(source.pp_degree):
        for j, run in enumerate(partition_data(source.get_data(pp_index=i), tp_degree)):
            target.add_data(i, j, run)
    return target


def _contract_pipeline_axis(source: meg_2d_parallel_map, pp_degree: int) -> meg_2d_parallel_map:
    target = meg_2d_parallel_map(pp_degree, source.tp_degree)
    for j in range(source.tp_degree):
        for i, run in enumerate(partition_data(source.get_data(tp_index=j), pp_degree)):
            target.add_data(i, j, run)
    return target


def reshape_meg_2d_parallel(old_pp_degree: int, old_tp_degree: int, new_pp_degree: int, new_tp_degree: int,
                            verbose: bool = False) -> meg_2d_parallel_map:
    """The model files each cell of the (new pipeline, new tensor) layout reads (see [Note: the 3D
    reshape maps])."""
    if new_pp_degree > old_pp_degree or new_tp_degree > old_tp_degree:
        raise ValueError(f"a reshape only contracts: ({old_pp_degree}, {old_tp_degree}) -> "
                         f"({new_pp_degree}, {new_tp_degree})")
    cells = meg_2d_parallel_map(old_pp_degree, old_tp_degree)
    cells.simple_init()
    if new_tp_degree != old_tp_degree:
        cells = _contract_tensor_axis(cells, new_tp_degree)
    if new_pp_degree != old_pp_degree:
        cells = _contract_pipeline_axis(cells, new_pp_degree)
    if verbose:
        cells.print_data("reshaped 2d map:")
    return cells


class model_3d_desc:  # noqa: N801 - DeepSpeed's name
    """A checkpoint's pipeline x tensor x data degrees, and the ZeRO-file map of a smaller layout."""

    def __init__(self, pp_degree: int = 1, tp_degree: int = 1, dp_degree: int = 1) -> None:
        self.pp_degree = pp_degree
        self.tp_degree = tp_degree
        self.dp_degree = dp_degree

    def reshape(self, target_3d_desc: model_3d_desc, verbose: bool = False) -> list[meg_2d_parallel_map]:
        """One 2D map per target data rank: the ZeRO-file indices each of its cells reads."""
        valid, errors = self.can_reshape(target_3d_desc)
        if not valid:
            raise ValueError(", ".join(errors))
        model_cells = reshape_meg_2d_parallel(self.pp_degree, self.tp_degree, target_3d_desc.pp_degree,
                                              target_3d_desc.tp_degree, verbose)
        files_per_data_rank = self.pp_degree * self.tp_degree
        per_rank = [meg_2d_parallel_map(model_cells.pp_degree, model_cells.tp_degree)
                    for _ in range(target_3d_desc.dp_degree)]
        for i in range(model_cells.pp_degree):
            for j in range(model_cells.tp_degree):
                zero_files = [m + d * files_per_data_rank for m in model_cells.get_data(i, j)
                              for d in range(self.dp_degree)]
                for cells, run in zip(per_rank, partition_data(zero_files, target_3d_desc.dp_degree)):
                    cells.add_data(i, j, run)
        return per_rank

    def get_desc(self) -> str:
        return f"{PP_DIM},{TP_DIM},{DP_DIM} = ({self.pp_degree}, {self.tp_degree}, {self.dp_degree})"

    def world_size(self) -> int:
        return self.pp_degree * self.tp_degree * self.dp_degree

    def is_valid(self, pp_index: int, tp_index: int, dp_index: int) -> tuple[bool, list[str]]:
        """Whether the indices name a rank of this layout, and what is wrong where they do not."""
        errors = [f"{dim} indexing error: index {index} >= degree {degree}"
                  for index, degree, dim in ((pp_index, self.pp_degree, PP_DIM), (tp_index, self.tp_degree, TP_DIM),
                                             (dp_index, self.dp_degree, DP_DIM)) if index >= degree]
        return not errors, errors

    def can_reshape(self, target_3d_desc: model_3d_desc) -> tuple[bool, list[str]]:
        """Whether ``target_3d_desc`` contracts every axis by a divisor, and each reason where it does not."""
        errors = []
        for dim, old, new in ((PP_DIM, self.pp_degree, target_3d_desc.pp_degree),
                              (TP_DIM, self.tp_degree, target_3d_desc.tp_degree),
                              (DP_DIM, self.dp_degree, target_3d_desc.dp_degree)):
            if new > old:
                errors.append(f"Expansion reshape not supported - {dim}: {old} ---> {new}")
            elif new < 1 or old % new:
                errors.append(f"{dim}: degree {new} does not divide the saved degree {old}")
        return not errors, errors
