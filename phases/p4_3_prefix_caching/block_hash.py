"""Naming a full KV block by everything that decides its contents.

A block's K/V depend on its own tokens and on every token before it (attention mixed them in). Hashing the
whole prefix per block would cost O(n^2) over a prompt; chaining covers it in one step per block:
h_i = hash(h_{i-1}, tokens of block i), with h_{-1} = ROOT_HASH. Only FULL blocks get a hash (a partly written one will change). A hash can collide, so it only names a
candidate that prefix_cache.py verifies; vLLM uses SHA-256, Python's tuple hash suffices once verified.
"""

from __future__ import annotations

ROOT_HASH = 0  # block 0's parent hash; not None: hash(None) changes between processes before Python 3.12


def hash_block(parent_hash: int, tokens: tuple[int, ...]) -> int:
    """The hash of one full block: its parent's hash and its own tokens."""
    return hash((parent_hash, tokens))


def block_tokens(token_ids: list[int], block_size: int, index: int) -> tuple[int, ...]:
    """The tokens of logical block `index` (a tuple: hashable, and cheap to compare)."""
    return tuple(token_ids[index * block_size:(index + 1) * block_size])


def chain_hashes(token_ids: list[int], block_size: int, parent_hash: int = ROOT_HASH,
                 start_block: int = 0) -> list[int]:
    """Hashes of the full blocks from `start_block` on; `parent_hash` is block `start_block - 1`'s hash."""
    hashes, h = [], parent_hash
    for i in range(start_block, len(token_ids) // block_size):   # full blocks only
        h = hash_block(h, block_tokens(token_ids, block_size, i))
        hashes.append(h)
    return hashes
