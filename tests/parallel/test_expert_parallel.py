"""Expert parallelism on CPU (gloo, 2 processes): the all-to-all dispatch and combine with
tokens split unevenly over the ranks (one rank may hold none) equals the single-rank MoE in
float32 (to the last bits its GEMMs' row grouping changes); `python -m aserve` serves a tiny
Mixtral to the openai client, on one rank and with `-tp 2 --enable-expert-parallel`; on a dense
model the flag changes nothing.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from helpers.server import free_port, wait_healthy

from aserve.distributed.all_to_all import all_to_all_moe, expert_owners
from aserve.distributed.state import expert_range, set_ep
from aserve.kernels.moe import fused_moe_ref, select_experts

HIDDEN, INTER, E, K = 16, 24, 5, 2


def moe_inputs(num_tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g)
    logits = torch.randn(num_tokens, E, generator=g)
    weights, ids = select_experts(logits, K, renormalize=True)
    return x, weights, ids


def _rank_main(rank: int, port: int, splits: list[int], out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    set_ep(rank, 2, dist.group.WORLD, "all-to-all")
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, HIDDEN, generator=g)
    w2 = torch.randn(E, HIDDEN, INTER, generator=g)
    mine = expert_range(E)
    expert_map = torch.full((E,), -1, dtype=torch.int32)
    expert_map[mine.start:mine.stop] = torch.arange(len(mine), dtype=torch.int32)

    def local(rows, weights, ids):
        return fused_moe_ref(rows, w13[mine.start:mine.stop], w2[mine.start:mine.stop], weights,
                             ids, expert_map=expert_map)

    x, weights, ids = moe_inputs(splits[rank], seed=rank + 1)
    out = all_to_all_moe(x, weights, ids, expert_owners(E, x.device), local)
    torch.save({"out": out, "want": fused_moe_ref(x, w13, w2, weights, ids)},
               f"{out_dir}/rank{rank}.pt")
    dist.barrier()  # neither rank leaves while the other still talks to it
    dist.destroy_process_group()


@pytest.mark.parametrize("splits", [[7, 3], [1, 0], [0, 4]])
def test_all_to_all_with_uneven_token_splits_matches_one_rank(tmp_path, splits):
    mp.start_processes(_rank_main, args=(free_port(), splits, str(tmp_path)), nprocs=2,
                       start_method="spawn")
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["out"].shape == (splits[rank], HIDDEN)
        # the same sums in the same order; only the GEMMs' row grouping differs (last bits)
        torch.testing.assert_close(result["out"], result["want"], rtol=1e-5, atol=1e-4)


def test_uneven_expert_placement():
    assert [expert_range(5, r, 2) for r in range(2)] == [range(0, 3), range(3, 5)]
    assert [len(expert_range(3, r, 4)) for r in range(4)] == [1, 1, 1, 0]  # a rank with none
    assert [expert_range(8, r, 4).start for r in range(4)] == [0, 2, 4, 6]


@pytest.mark.parametrize("layout", [[], ["-tp", "2", "--enable-expert-parallel"]],
                         ids=["one-rank", "tp2-ep"])
def test_server_on_a_tiny_mixtral_answers_openai_client(moe_dir_factory, tmp_path, layout):
    from openai import OpenAI

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "stderr.log", "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aserve", "--model", str(moe_dir_factory("mixtral")),
             "--port", str(port), "--dtype", "float32", "--max-model-len", "256", *layout,
             "--served-model-name", "tiny-moe"],
            stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        wait_healthy(proc, url)
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        out = client.chat.completions.create(
            model="tiny-moe", messages=[{"role": "user", "content": "Hello there"}],
            max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_expert_parallel_on_a_dense_model_changes_nothing(llama_dir):
    from helpers.parity import generate_ids

    from aserve import LLM

    prompts = [[5, 9, 200, 31, 7, 64], [100, 3, 4]]
    with LLM(llama_dir, dtype="float32", tensor_parallel_size=2) as llm:
        want = generate_ids(llm, prompts, 8)
    with LLM(llama_dir, dtype="float32", tensor_parallel_size=2,
             enable_expert_parallel=True) as llm:
        assert generate_ids(llm, prompts, 8) == want
