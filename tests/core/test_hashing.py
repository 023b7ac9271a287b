"""Block hashes: stable across processes, chained on the parent, sensitive to extra keys."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers.requests import make_request

from aserve.core.hashing import hash_block_tokens, update_block_hashes

# Computed once by hash_block_tokens and pinned: a change here invalidates every stored hash.
PINNED = {
    "plain": "a8012a66a7efcd6dc635d6fb0ddb50fcf083453f10c24707eaeb813548f185a5",
    "salted": "ce39376e250fcdbfc4bd6ef366729799541feeb26f32872db170ffca4b2425fc",
    "chained": "fcebde723ce279fcc3dccdf2a4a335fbdd00852d1497fb369e19467756b18b6f",
}




def test_hash_matches_pinned_digests() -> None:
    plain = hash_block_tokens(None, [1, 2, 3, 4])
    assert plain.hex() == PINNED["plain"]
    assert hash_block_tokens(None, [1, 2, 3, 4], ("salt",)).hex() == PINNED["salted"]
    assert hash_block_tokens(plain, [5, 6, 7, 8]).hex() == PINNED["chained"]
    assert len(plain) == 32


def test_hash_is_deterministic_and_accepts_any_sequence() -> None:
    assert hash_block_tokens(None, [1, 2, 3, 4]) == hash_block_tokens(None, (1, 2, 3, 4))
    assert hash_block_tokens(None, range(1, 5)) == hash_block_tokens(None, [1, 2, 3, 4])


def test_parent_hash_changes_the_hash() -> None:
    base = hash_block_tokens(None, [5, 6, 7, 8])
    parent_a = hash_block_tokens(None, [1, 2, 3, 4])
    parent_b = hash_block_tokens(None, [1, 2, 3, 5])
    with_a = hash_block_tokens(parent_a, [5, 6, 7, 8])
    with_b = hash_block_tokens(parent_b, [5, 6, 7, 8])
    assert len({base, with_a, with_b}) == 3
    assert hash_block_tokens(b"", [5, 6, 7, 8]) != base  # empty parent is not "no parent"


def test_tokens_and_extra_keys_change_the_hash() -> None:
    base = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(None, [1, 2, 4, 3]) != base
    assert hash_block_tokens(None, [1, 2, 3]) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], ("a",)) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], ("a",)) != hash_block_tokens(
        None, [1, 2, 3, 4], ("b",))
    assert hash_block_tokens(None, [1, 2, 3, 4], (1,)) != hash_block_tokens(
        None, [1, 2, 3, 4], ("1",))
    assert hash_block_tokens(None, [1, 2, 3, 4], ()) == base


def test_large_and_negative_token_ids_are_distinct() -> None:
    assert hash_block_tokens(None, [2**40]) != hash_block_tokens(None, [0])
    assert hash_block_tokens(None, [-1]) != hash_block_tokens(None, [2**63 - 1])


def test_unsupported_extra_key_type_is_rejected() -> None:
    with pytest.raises(TypeError, match="extra keys"):
        hash_block_tokens(None, [1], (object(),))


@pytest.mark.spawns
def test_hash_is_the_same_under_another_pythonhashseed() -> None:
    code = ("from aserve.core.hashing import hash_block_tokens as h; "
            "p = h(None, [1, 2, 3, 4], ('salt',)); print(p.hex(), h(p, [5, 6]).hex())")
    here = hash_block_tokens(None, [1, 2, 3, 4], ("salt",))
    expected = f"{here.hex()} {hash_block_tokens(here, [5, 6]).hex()}"
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True)
        assert out.stdout.strip() == expected


def test_update_block_hashes_covers_only_full_blocks() -> None:
    request = make_request(prompt=list(range(10)))
    update_block_hashes(request, block_size=4)
    h0 = hash_block_tokens(None, [0, 1, 2, 3])
    h1 = hash_block_tokens(h0, [4, 5, 6, 7])
    assert request.block_hashes == [h0, h1]


def test_update_block_hashes_is_incremental() -> None:
    request = make_request(prompt=list(range(7)))
    update_block_hashes(request, block_size=4)
    assert len(request.block_hashes) == 1
    first = request.block_hashes[0]
    request.append_output_token_ids([7])
    update_block_hashes(request, block_size=4)
    assert request.block_hashes[0] is first
    assert request.block_hashes[1] == hash_block_tokens(first, [4, 5, 6, 7])
    update_block_hashes(request, block_size=4)  # nothing new: unchanged
    assert len(request.block_hashes) == 2


def test_cache_salt_goes_into_the_first_block_only() -> None:
    salted = make_request(prompt=list(range(8)), cache_salt="s")
    update_block_hashes(salted, block_size=4)
    h0 = hash_block_tokens(None, [0, 1, 2, 3], ("s",))
    assert salted.block_hashes == [h0, hash_block_tokens(h0, [4, 5, 6, 7])]
    plain = make_request(prompt=list(range(8)))
    update_block_hashes(plain, block_size=4)
    assert plain.block_hashes[0] != h0 and plain.block_hashes[1] != salted.block_hashes[1]
