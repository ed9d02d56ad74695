"""Naming a full KV block by everything that decides its contents.

The K/V stored for token position p depend on token p *and on every token
before it* (attention mixed them in). So a block's contents are fixed by two
things: the tokens before the block and the block's own tokens. Two requests
whose prompts agree on both can use the same physical block.

Hashing the whole prefix for every block would cost O(n^2) over a prompt.
Chaining avoids that: block i's hash covers block i-1's hash, which already
covers everything before it:

    h_0 = hash(ROOT_HASH, tokens of block 0)
    h_i = hash(h_{i-1},   tokens of block i)

Only FULL blocks get a hash: a partly written block will still change.

A 64-bit hash can collide, so a hash only names a *candidate*; the cache
confirms it by comparing the stored tokens (prefix_cache.py). vLLM hashes with
SHA-256; Python's hash of a tuple of ints is fast, deterministic across runs,
and enough once every hit is verified.
"""

from __future__ import annotations

# The "parent hash" of block 0. An int, not None: hash(None) changes from one
# Python process to the next before 3.12, and we want the same hashes every run.
ROOT_HASH = 0


def hash_block(parent_hash: int, tokens: tuple[int, ...]) -> int:
    """The hash of one full block: its parent's hash and its own tokens."""
    return hash((parent_hash, tokens))


def block_tokens(token_ids: list[int], block_size: int, index: int) -> tuple[int, ...]:
    """The tokens of logical block `index` (a tuple: hashable, and cheap to compare)."""
    return tuple(token_ids[index * block_size:(index + 1) * block_size])


def chain_hashes(token_ids: list[int], block_size: int, parent_hash: int = ROOT_HASH,
                 start_block: int = 0) -> list[int]:
    """Hashes of the full blocks of `token_ids` from `start_block` on, chained from `parent_hash`.

    `parent_hash` must be the hash of block `start_block - 1` (ROOT_HASH for
    block 0): a sequence extends its chain a block at a time as it generates.
    """
    hashes, h = [], parent_hash
    for i in range(start_block, len(token_ids) // block_size):   # full blocks only
        h = hash_block(h, block_tokens(token_ids, block_size, i))
        hashes.append(h)
    return hashes
