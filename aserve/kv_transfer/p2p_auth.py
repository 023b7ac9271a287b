"""Who a P2P consumer trusts: the operator's shared secret, and the producers it names.

Producers and consumers share one secret (`ASERVE_KV_SECRET`, or
`kv_connector_extra_config.secret`; the environment wins, and keeps the secret out of `ps` and
of the command line's logs). With it:

- a producer signs the `kv_transfer_params` it hands out (`sign_params`: HMAC-SHA256 over the
  canonical JSON of every other key, in `remote_signature`), and a consumer loads only params
  that carry a good signature (`has_valid_signature`): a client cannot name the address a
  consumer connects to, nor alter the blocks, handle or prompt it names;
- a consumer proves it holds the secret when it connects (`hello_proof`, over a nonce the
  producer sent first), so a stranger on the producer's KV port is refused before anything is
  opened for it.

`kv_connector_extra_config.producers` ("host:port", each a producer's kv_ip:kv_port) narrows the
addresses a consumer connects to further (`parse_producers`). Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from typing import Any

SECRET_ENV = "ASERVE_KV_SECRET"
MIN_SECRET_CHARS = 16
SIGNATURE_KEY = "remote_signature"


def resolve_secret(extra: Mapping[str, Any]) -> bytes:
    """The shared secret: `ASERVE_KV_SECRET`, else `extra["secret"]`; a ValueError naming both
    ways to set it when neither is (or it is too short to be a secret)."""
    value = os.environ.get(SECRET_ENV) or extra.get("secret")
    if value is None or value == "":
        raise ValueError(
            f"P2pConnector needs a secret shared by its producers and consumers: set the "
            f"environment variable {SECRET_ENV} (preferred: it stays out of `ps`) or "
            "kv_connector_extra_config.secret, e.g. to the output of `openssl rand -hex 32`.")
    if not isinstance(value, str) or len(value) < MIN_SECRET_CHARS:
        raise ValueError(f"The P2pConnector secret ({SECRET_ENV} or "
                         f"kv_connector_extra_config.secret) must be a string of at least "
                         f"{MIN_SECRET_CHARS} characters.")
    return value.encode()


def _digest(secret: bytes, domain: str, payload: str) -> str:
    return hmac.new(secret, f"{domain}\n{payload}".encode(), hashlib.sha256).hexdigest()


def _canonical(params: Mapping[str, Any]) -> str:
    unsigned = {k: v for k, v in params.items() if k != SIGNATURE_KEY}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":"))


def sign_params(params: Mapping[str, Any], secret: bytes) -> str:
    """The signature of every key of `params` but `remote_signature`."""
    return _digest(secret, "aserve-kv-params", _canonical(params))


def has_valid_signature(params: Mapping[str, Any], secret: bytes) -> bool:
    signature = params.get(SIGNATURE_KEY)
    if not isinstance(signature, str):
        return False
    try:
        expected = sign_params(params, secret)
    except (TypeError, ValueError):  # not JSON (offline params may hold anything)
        return False
    return hmac.compare_digest(signature.encode(), expected.encode())


def hello_proof(secret: bytes, nonce: str, kv_cache_key: str, rank: int) -> str:
    """A consumer rank's answer to a producer's nonce: it holds the secret."""
    return _digest(secret, "aserve-kv-hello", f"{nonce}\n{kv_cache_key}\n{rank}")


def has_valid_proof(hello: Mapping[str, Any], secret: bytes, nonce: str) -> bool:
    proof, key, rank = hello.get("proof"), hello.get("kv_cache_key"), hello.get("rank")
    if not (isinstance(proof, str) and isinstance(key, str) and isinstance(rank, int)):
        return False
    return hmac.compare_digest(proof.encode(), hello_proof(secret, nonce, key, rank).encode())


def parse_producers(value: Any) -> frozenset[tuple[str, int]] | None:
    """`kv_connector_extra_config.producers` as (host, port) pairs; None: not given (any
    producer that signs its params). A ValueError for anything but a list of "host:port"."""
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise ValueError("kv_connector_extra_config.producers must be a non-empty list of "
                         f"\"host:port\" strings (producers' kv_ip:kv_port), got {value!r}.")
    return frozenset(_parse_address(item) for item in value)


def is_allowed(producers: frozenset[tuple[str, int]] | None, host: Any, port: Any) -> bool:
    """Whether a consumer may connect to the producer at host:port (`producers`: None, any)."""
    if producers is None:
        return True
    return isinstance(host, str) and type(port) is int and (host, port) in producers


def _parse_address(item: Any) -> tuple[str, int]:
    host, _, port = item.rpartition(":") if isinstance(item, str) else ("", "", "")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("kv_connector_extra_config.producers must hold \"host:port\" strings "
                         f"(a producer's kv_ip:kv_port), got {item!r}.")
    return host, int(port)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
