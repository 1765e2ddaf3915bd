"""The job's axes (``ParallelDims``): the rank rule and every group list, pure arithmetic, no processes."""

from __future__ import annotations

import itertools

import pytest

from zeroshard.distributed.parallel_dims import (GROUP_KINDS, Coords, ExpertParallelError, HybridShardingError,
                                                 ParallelDims, StagesDoNotDivideError, TensorParallelSizeError)
from zeroshard.experts.groups import ExpertParallelError as ExpertsError
from zeroshard.planning import parallel_search, scale_model
from zeroshard.planning.estimator import EstimateRequest, ModelShape, TensorShape
from zeroshard.tensor_parallel import TensorParallelSizeError as TensorError


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _every_small_job() -> list[ParallelDims]:
    """Every combination of pipeline, data, sequence and tensor sizes up to 3, 4, 2 and 2, with every
    MiCS, hpZ and expert cut of the ZeRO world."""
    jobs = []
    for pp, dp, sp, tp in itertools.product((1, 2, 3), (1, 2, 3, 4), (1, 2), (1, 2)):
        zero = dp * sp
        for replicate in _divisors(dp):
            for hpz in _divisors(zero) if replicate == 1 else [1]:
                for ep in _divisors(zero):
                    jobs.append(ParallelDims(pp, dp, tp, dp_replicate=replicate, hpz=hpz, ep=ep, sp=sp))
    return jobs


JOBS = _every_small_job()


def test_rank_of_and_coords_are_inverse_and_follow_the_documented_order() -> None:
    for dims in JOBS:
        seen = set()
        for stage, data, seq, tensor in itertools.product(range(dims.pp), range(dims.dp), range(dims.sp),
                                                          range(dims.tp)):
            rank = dims.rank_of(stage, data, tensor, seq=seq)
            # [Note: the order of the axes]: pipeline outermost, then data, sequence, tensor innermost
            assert rank == ((stage * dims.dp + data) * dims.sp + seq) * dims.tp + tensor
            assert dims.coords(rank) == Coords(stage, data, tensor, seq)
            assert dims.zero_position(rank) == data * dims.sp + seq
            assert dims.rank_at(stage, tensor, data * dims.sp + seq) == rank
            seen.add(rank)
        assert seen == set(range(dims.world_size)), dims


def test_each_kind_of_group_partitions_the_world() -> None:
    for dims in JOBS:
        for kind in GROUP_KINDS:
            groups = dims.groups(kind)
            flat = sorted(r for g in groups for r in g)
            assert flat == list(range(dims.world_size)), (dims, kind)
            assert len({len(g) for g in groups}) == 1, (dims, kind)
            for index, group in enumerate(groups):
                assert dims.group_of(kind, group[-1]) == (index, group)


def test_each_group_varies_only_its_own_axes() -> None:
    varies = {"pipeline": {"stage"}, "tensor": {"tensor"}, "zero": {"data", "seq"}, "data": {"data"},
              "sequence": {"seq"}}
    for dims in JOBS:
        for kind, axes in varies.items():
            for group in dims.groups(kind):
                where = [dims.coords(r)._asdict() for r in group]
                fixed = set(Coords._fields) - axes
                assert all(w[a] == where[0][a] for w in where for a in fixed), (dims, kind, group)


def _old_blocks(n: int, size: int) -> list[list[int]]:
    """build_shard_groups's rule before the axes: blocks of ``size`` consecutive ranks of the world."""
    return [list(range(start, start + size)) for start in range(0, n, size)]


def _old_strided(n: int, size: int) -> list[list[int]]:
    return [list(range(position, n, size)) for position in range(size)]


@pytest.mark.parametrize("world", [1, 2, 4, 6, 8, 12, 16])
def test_mics_hpz_and_expert_groups_are_the_blocks_and_strides_the_engine_made(world: int) -> None:
    for size in _divisors(world):
        mics = ParallelDims.for_job(world, mics_shard_size=size)
        shard, replicas = [list(g) for g in mics.positions("shard")], [list(g) for g in mics.positions("replicate")]
        assert shard == _old_blocks(world, size)
        assert replicas == _old_strided(world, size) if size < world else replicas == [[r] for r in range(world)]
        assert (mics.dp_replicate > 1) == (size < world)
        hpz = ParallelDims.for_job(world, hpz_partition_size=size)
        if 1 < size < world:
            assert [list(g) for g in hpz.positions("secondary")] == _old_blocks(world, size)
        else:
            assert hpz.hpz == 1
        ep = ParallelDims.for_job(world, ep=size)
        assert [list(g) for g in ep.positions("expert")] == _old_blocks(world, size)
        assert [list(g) for g in ep.positions("expert_data")] == _old_strided(world, size)


def test_a_pipeline_of_tensor_parallel_stages_numbers_ranks_as_deepspeed() -> None:
    dims = ParallelDims(pp=2, dp=2, tp=2)
    assert dims.groups("tensor") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert dims.groups("zero") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert dims.pipelines() == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert dims.data_parallel_ranks(1, 1) == (5, 7)


def test_sizes_that_do_not_divide_are_refused_by_name() -> None:
    with pytest.raises(StagesDoNotDivideError, match="num_stages=3 does not divide the world size 8"):
        ParallelDims.for_job(8, pp=3)
    with pytest.raises(TensorParallelSizeError, match="tensor_parallel.autotp_size = 3 does not divide the 4 ranks"):
        ParallelDims.for_job(4, tp=3)
    for key, arguments in (("mics_shard_size", {"mics_shard_size": 3}),
                           ("zero_hpz_partition_size", {"hpz_partition_size": 3})):
        with pytest.raises(HybridShardingError, match=f"zero_optimization.{key} = 3 does not divide the world "
                                                      f"size 4"):
            ParallelDims.for_job(4, **arguments)  # type: ignore[arg-type]
    with pytest.raises(ExpertParallelError, match=r"MoE\(ep_size=3\) does not divide the data-parallel world of 4"):
        ParallelDims.for_job(4, ep=3)
    with pytest.raises(HybridShardingError):
        ParallelDims(1, 4, dp_replicate=2, hpz=2)
    with pytest.raises(ValueError, match="parallel sizes must be >= 1"):
        ParallelDims(1, 4, sp=0)
    # the types the code before the axes raised, under their old import paths
    assert ExpertsError is ExpertParallelError and TensorError is TensorParallelSizeError
    assert issubclass(HybridShardingError, ValueError)


def test_the_scale_model_places_groups_by_the_axes_rule() -> None:
    """The planner asks the axes; here its placements are checked against the rule written out."""
    for pp, dp, tp, node in itertools.product((1, 2), (2, 4, 8), (1, 2, 4), (2, 4, 8)):
        dims = ParallelDims(pp, dp, tp)

        def by_rule(index_groups: list[list[int]]) -> list[list[int]]:
            return [[(stage * dp + d) * tp + t for d in indices]
                    for stage in range(pp) for t in range(tp) for indices in index_groups]

        for mics in _divisors(dp):
            groups = scale_model._zero_groups(dims, node, mics, None)
            assert groups.shard == scale_model.group_placement(by_rule(_old_blocks(dp, mics)), node)
            assert groups.data == scale_model.group_placement(by_rule([list(range(dp))]), node)
            if mics < dp:
                assert groups.replicas == scale_model.group_placement(by_rule(_old_strided(dp, mics)), node)
        tensor = [[(s * dp + d) * tp + t for t in range(tp)] for s in range(pp) for d in range(dp)]
        assert [list(g) for g in dims.groups("tensor")] == tensor
        pairs = {((s * dp + d) * tp + t, ((s + 1) * dp + d) * tp + t)
                 for s in range(pp - 1) for d in range(dp) for t in range(tp)}
        assert {pair for pipe in dims.pipelines() for pair in zip(pipe, pipe[1:])} == pairs
        # the search's tensor and pipeline groups are these lists (parallel_search asks dims for them)
        if tp > 1:
            request = _search_request(tp)
            traffic = parallel_search.tensor_parallel_traffic(request, dims, node)[0]
            placed = scale_model.group_placement(tensor, node)
            assert (traffic.crosses_nodes, traffic.ranks_per_node) == (placed.crosses_nodes, placed.ranks_per_node)


def _search_request(tp: int) -> EstimateRequest:
    return EstimateRequest(num_params=1e9, world_size=tp, micro_batch=1, seq_len=128,
                           shape=ModelShape(hidden=256, layers=2), tensor=TensorShape(tp, 1e8))
