"""KV buffers under a hybrid cache: buffer i serves layer i of every group, so a block is one
group's layers' worth of memory, and a stage allocates only the buffers its layers use."""

from __future__ import annotations

import pytest
import torch

from aserve.config import KVCacheGroupSpec
from aserve.core.kv_cache_utils import (
    blocks_per_request,
    make_kv_cache_groups,
    max_blocks_per_request,
)
from aserve.runner.kv_cache import allocate_kv_buffers, kv_buffer_ids, layer_placement

GEMMA2_26 = [4096 if i % 2 == 0 else None for i in range(26)]  # even layers slide
GEMMA3_26 = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]  # every 6th is full


def test_gemma2_pattern_is_two_groups_of_13_over_13_buffers():
    groups = make_kv_cache_groups(GEMMA2_26, 16)
    assert [(g.sliding_window, g.layers) for g in groups] == [
        (None, tuple(range(1, 26, 2))), (4096, tuple(range(0, 26, 2)))]
    placement = layer_placement(groups)
    assert placement[1] == (0, 0) and placement[0] == (1, 0) and placement[25] == (0, 12)
    assert kv_buffer_ids(groups, range(26)) == list(range(13))


def test_gemma3_pattern_splits_the_sliding_layers_into_groups_of_the_full_count():
    groups = make_kv_cache_groups(GEMMA3_26, 16)
    assert groups[0].layers == (5, 11, 17, 23) and groups[0].sliding_window is None
    sliding = groups[1:]
    assert all(g.sliding_window == 512 and len(g.layers) <= 4 for g in sliding)
    assert sorted(x for g in sliding for x in g.layers) == [
        i for i in range(26) if (i + 1) % 6]
    assert kv_buffer_ids(groups, range(26)) == [0, 1, 2, 3]  # 4 buffers for 26 layers


def test_one_kind_is_one_group_of_every_layer():
    assert make_kv_cache_groups([None] * 3, 8) == (KVCacheGroupSpec((0, 1, 2), None, 8),)
    assert make_kv_cache_groups([7] * 2, 8) == (KVCacheGroupSpec((0, 1), 7, 8),)


def test_a_pipeline_stage_allocates_only_its_layers_buffers():
    groups = make_kv_cache_groups(GEMMA2_26, 16)
    assert kv_buffer_ids(groups, range(0, 4)) == [0, 1]  # layers 0-3: buffers 0, 1
    buffers = allocate_kv_buffers(_Arch(), 5, 16, [0, 1], 2, torch.device("cpu"))
    assert sorted(buffers) == [0, 1] and buffers[0].shape == (2, 5, 16, 2, 8)
    with pytest.raises(ValueError, match="no KV cache group"):
        kv_buffer_ids(groups, [26])


def test_a_sliding_group_needs_about_its_window_per_request():
    full, window = KVCacheGroupSpec((0,), None, 16), KVCacheGroupSpec((1,), 100, 16)
    assert max_blocks_per_request(full, 4096, 512) == 256
    # the window's 99 earlier tokens + a 512-token step, + 1 for an unaligned window start
    assert max_blocks_per_request(window, 4096, 512) == -(-(99 + 512) // 16) + 1
    assert max_blocks_per_request(window, 64, 512) == 4  # never more than the whole length
    assert blocks_per_request((full, window), 4096, 16) == 256 + -(-(99 + 16) // 16) + 1


class _Arch:
    dtype = torch.float32
    head_dim = 8
