"""The Ulysses attention layer on 2 gloo ranks equals single-rank paged attention: random
q/k/v of a mixed step (prefills, decodes, chunks after cached context; 17 rows, so one rank
holds a padding row), GQA split by kv heads, MQA and GQA with kv heads replicated over the SP
ranks, a window with sinks and a soft-cap; each rank's KV cache ends as its heads' share of the
single-rank cache (the step's K/V written, the padding row's nowhere)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from helpers.attention import build_metadata, make_batch
from helpers.server import free_port

from aserve.layers.attention import Attention

REQS = [(7, 7), (1, 9), (3, 20), (1, 1), (5, 17)]  # (q_len, seq_len): 17 rows
HEAD_DIM, BLOCK_SIZE, SP = 8, 4, 2
# name -> (query heads, kv heads, window, soft-cap, sinks)
CASES = {
    "gqa-split": (4, 2, None, None, False),
    "mqa-replicated": (4, 1, None, None, False),
    "gqa-replicated-window-sinks": (6, 1, 5, None, True),
    "mha-soft-cap": (4, 4, None, 3.0, False),
}


def step(case: str):
    """The case's layer arguments, its step (new rows' q/k/v [T, H*D], metadata) and a cache
    holding the context, the new rows' slots NaN (so the layer must write them)."""
    num_heads, num_kv_heads, window, cap, with_sinks = CASES[case]
    q, k_cache, v_cache, starts, seq_lens, table, keys, values = make_batch(
        REQS, num_heads, num_kv_heads, HEAD_DIM, BLOCK_SIZE, seed=len(case))
    blocks = [[b for b in row if b >= 0] for row in table.tolist()]
    meta = build_metadata([q_len for q_len, _ in REQS], seq_lens.tolist(), blocks, BLOCK_SIZE)
    k_new = torch.cat([kr[s - n:] for kr, (n, s) in zip(keys, REQS, strict=True)])
    v_new = torch.cat([vr[s - n:] for vr, (n, s) in zip(values, REQS, strict=True)])
    cache = torch.stack([k_cache, v_cache]).flatten(1, 2)  # [2, NB * BS, Hkv, D]
    cache[:, meta.slot_mapping] = float("nan")
    cache = cache.view(2, -1, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(7)) if with_sinks \
        else None
    layer = (num_heads, num_kv_heads, HEAD_DIM, 0.4, window, cap)
    return layer, (q.flatten(1), k_new.flatten(1), v_new.flatten(1)), meta, cache, sinks


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from aserve.distributed.state import set_sp
    from aserve.layers.ulysses import UlyssesAttention

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=SP)
    set_sp(rank, SP, dist.group.WORLD)
    results = {}
    for case in CASES:
        layer_args, (q, k, v), meta, cache, sinks = step(case)
        reference = Attention(*layer_args)
        reference.bind_kv_cache(cache.clone())
        want = reference(q, k, v, meta, sinks=sinks)  # [T, H*D]
        ulysses = UlyssesAttention(*layer_args)
        ulysses.bind_kv_cache(cache[:, :, :, ulysses.kv_index[rank]].clone())
        chunk = -(-q.shape[0] // SP)
        rows = slice(rank * chunk, (rank + 1) * chunk)
        padded = [torch.cat([x[rows], torch.randn(chunk - len(x[rows]), x.shape[1]) * 1e3])
                  for x in (q, k, v)]  # garbage in the padding row: it must go nowhere
        got = ulysses(*padded, meta, sinks=sinks)
        results[case] = {
            "got": got[:len(q[rows])], "want": want[rows], "shape": tuple(got.shape),
            "cache": ulysses.kv_cache,
            "want_cache": reference.kv_cache[:, :, :, ulysses.kv_index[rank]],
            "heads": (ulysses.num_heads, ulysses.num_kv_heads)}
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_ulysses_attention_on_two_ranks_matches_single_rank_paged_attention(tmp_path):
    mp.start_processes(_rank_main, args=(free_port(), str(tmp_path)), nprocs=SP,
                       start_method="spawn")
    num_rows = sum(q_len for q_len, _ in REQS)
    for rank in range(SP):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for case, (num_heads, num_kv_heads, *_rest) in CASES.items():
            r = results[case]
            assert r["heads"] == (num_heads // SP, max(1, num_kv_heads // SP)), case
            assert r["shape"] == (-(-num_rows // SP), num_heads * HEAD_DIM), case
            torch.testing.assert_close(r["got"], r["want"], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, case=case: f"{case}: {m}")
            # every slot as the single rank left it: the step's K/V written, NaN nowhere
            assert not r["cache"].isnan().any(), case
            assert torch.equal(r["cache"], r["want_cache"]), case


@pytest.mark.parametrize(("heads", "kv_heads", "sp", "match"), [
    (6, 2, 4, "must divide the attention heads"), (6, 3, 2, "must divide one another")])
def test_heads_that_sp_cannot_split_are_refused_naming_the_constraint(heads, kv_heads, sp,
                                                                      match):
    from aserve.layers.ulysses import sp_head_split

    with pytest.raises(ValueError, match=match):
        sp_head_split(heads, kv_heads, sp)
    assert sp_head_split(8, 2, 4) == (2, 1)  # 4 SP ranks share 2 kv heads: one each, replicated
