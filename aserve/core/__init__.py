"""The engine's pure-Python core: requests, scheduling, and the paged KV-cache bookkeeping.

Nothing here imports torch. Blocks are ids, hashes are over tuples of token ids.

Glossary (these words mean exactly this everywhere in aserve):

token     one token id of a request, prompt or output.
block     a fixed-size page of the KV cache holding `block_size` consecutive tokens of one
          request; identified by its `block_id` (an int index into the KV tensors).
slot      one token's place in the KV cache: `block_id * block_size + offset`.
computed  tokens whose K/V are already in the cache (`num_computed_tokens`).
scheduled tokens this step will compute (`num_scheduled_tokens[req_id]`).
cached    computed tokens found through the prefix cache instead of computed for this
          request (`num_cached_tokens`); a cached block is a full block registered under its
          cache key: (block hash, group id).
group     a KV cache group (`KVCacheGroupSpec`): layers of one attention kind (full, or
          sliding with window W) sharing one block table per request; every group covers
          the same tokens with the same block size, from one shared `BlockPool`.
window    a sliding group's W: the query at position p reads keys [p - W + 1, p] only.
skipped   a block of a sliding group wholly before the window of the first token still to
          compute: never read again, so it is freed and the request's list holds the null
          block in its place.
null block  block 0, reserved in every pool: stands for a skipped slot; never free, never
          cached, never referenced.
"""
