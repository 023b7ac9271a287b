"""Stable, chained hashes of full KV-cache blocks: the keys of the prefix cache.

A block's hash covers its parent's hash, its own token ids and its extra keys, so equal hashes
mean equal whole prefixes, not just equal blocks:

    tokens   [t0 .. t15][t16 .. t31][t32 .. t47][t48 t49]     (block_size 16)
    hashes   h0 ──────► h1 ───────► h2                       (the last block is not full:
             h0 = H(None, t0..t15, (salt,))                    no hash)
             h1 = H(h0,   t16..t31, None)

The hash is sha256 over a canonical byte encoding, the same in every process, run and machine
(never Python's `hash()`, which is salted per process). Only full blocks are hashed.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

from aserve.core.request import Request

_DOMAIN = b"aserve.block.v1"
_EXTRA_KEY_TYPES = (str, int, bytes, type(None))


def _pack_len(n: int) -> bytes:
    return struct.pack("<Q", n)


def _check_extra_keys(keys: tuple) -> None:
    for key in keys:
        if isinstance(key, tuple):
            _check_extra_keys(key)
        elif not isinstance(key, _EXTRA_KEY_TYPES):
            raise TypeError(f"extra keys must be str, int, bytes, None or tuples of these, "
                            f"got {type(key).__name__}: {key!r}.")


def _encode_tokens(token_ids: Sequence[int]) -> bytes:
    packed = array("q", token_ids)  # int64
    if sys.byteorder == "big":
        packed.byteswap()  # little-endian on every machine
    return _pack_len(len(packed)) + packed.tobytes()


def _encode_optional(data: bytes | None) -> bytes:
    if data is None:
        return b"\x00"
    return b"\x01" + _pack_len(len(data)) + data


def hash_block_tokens(
    parent_hash: bytes | None,
    token_ids: Sequence[int],
    extra_keys: tuple | None = None,
) -> bytes:
    """The 32-byte hash of one full block, chained on its parent's hash.

    `extra_keys` (e.g. a cache salt) must hold str, int, bytes, None or tuples of these; it is
    encoded as its `repr`, which is stable for those types. An empty tuple counts as None.
    """
    extra: bytes | None = None
    if extra_keys:
        _check_extra_keys(extra_keys)
        extra = repr(tuple(extra_keys)).encode()
    digest = hashlib.sha256(_DOMAIN)
    digest.update(_encode_optional(parent_hash))
    digest.update(_encode_tokens(token_ids))
    digest.update(_encode_optional(extra))
    return digest.digest()


def update_block_hashes(request: Request, block_size: int) -> None:
    """Extend `request.block_hashes` to cover every full block of `request.all_token_ids`.

    Incremental: blocks hashed before are not hashed again. The request's `cache_salt` (when
    set) is an extra key of the first block only; the chain carries it to every later block.
    """
    hashes = request.block_hashes
    tokens = request.all_token_ids
    for index in range(len(hashes), len(tokens) // block_size):
        parent = hashes[-1] if hashes else None
        extra = (request.cache_salt,) if index == 0 and request.cache_salt is not None else None
        start = index * block_size
        hashes.append(hash_block_tokens(parent, tokens[start:start + block_size], extra))
