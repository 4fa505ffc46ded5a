"""The one block rule (``allreduce_kit.blocks``): contiguous blocks in rank order covering the
buffer, lengths within one of each other, for any length and rank count, and the rule the
allreduce algorithms cut their buffers by."""
import numpy as np
import pytest

from allreduce_kit import blocks, shard_bounds
from allreduce_kit.algorithms import segments

CASES = [(n, p) for p in (1, 2, 3, 4, 5, 7, 8, 16) for n in (0, 1, p - 1, p, p + 1, 10, 1000, 2**20 + 3)]


@pytest.mark.parametrize("n, p", CASES)
def test_blocks_cover_the_buffer_in_rank_order(n, p):
    bounds = shard_bounds(n, p)
    assert len(bounds) == p + 1 and bounds[0] == 0 and bounds[-1] == n
    lengths = np.diff(bounds)
    assert (lengths >= 0).all() and lengths.max() - lengths.min() <= 1
    assert blocks.counts(n, p) == list(lengths)
    assert blocks.displacements(n, p) == bounds[:-1]
    assert [blocks.block(n, p, r) for r in range(p)] == list(zip(bounds[:-1], bounds[1:]))


@pytest.mark.parametrize("n, p", [(n, p) for n, p in CASES if n <= 1000])
def test_owner_is_the_block_holding_an_element(n, p):
    bounds = shard_bounds(n, p)
    for i in range(n):
        r = blocks.owner(n, p, i)
        assert bounds[r] <= i < bounds[r + 1]


def test_fewer_elements_than_ranks_leaves_empty_blocks():
    assert blocks.counts(2, 5) == [0, 0, 1, 0, 1]


def test_allreduce_segments_follow_the_rule():
    for n, p in CASES:
        assert segments.segment_bounds(n, p) == shard_bounds(n, p)
        assert list(segments.bounds_array(n, p)) == shard_bounds(n, p)


@pytest.mark.parametrize("call", [lambda: shard_bounds(-1, 2), lambda: shard_bounds(4, 0),
                                  lambda: blocks.block(4, 2, 2), lambda: blocks.owner(4, 2, 4)])
def test_out_of_range_arguments_raise(call):
    with pytest.raises(ValueError):
        call()
