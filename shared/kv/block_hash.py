"""Page hashes of the prefix cache: a full page of KV is named by a hash chained over every token
up to its end, so two requests share a page only if they share everything before it too. The
same function runs in the engine (shared/kv/prefix_cache.py), in the workers' KV events and in
the scheduler's router, in different processes: blake2b, not Python's per-process `hash`.

A request's `cache_salt` (vLLM's name) seeds its chain: tenants with different salts never
share a page. Pure: no torch."""

import hashlib
import struct

HASH_BYTES = 8  # 64-bit page hashes: a collision needs ~4e9 distinct pages in one index


def page_hashes(
    token_ids: list[int], page_size: int, salt: str = "", parent: int | None = None,
    first_page: int = 0,
) -> list[int]:  # fmt: skip
    """The hashes of the full pages of `token_ids` from page `first_page` on; `parent` is the
    hash of page first_page - 1 (None at the start of a sequence, where `salt` seeds it)."""
    out = []
    seed = b"salt:" + salt.encode() if parent is None else parent.to_bytes(HASH_BYTES, "little")
    for page in range(first_page, len(token_ids) // page_size):
        tokens = token_ids[page * page_size : (page + 1) * page_size]
        digest = hashlib.blake2b(
            seed + struct.pack(f"<{page_size}I", *tokens), digest_size=HASH_BYTES
        ).digest()
        out.append(int.from_bytes(digest, "little"))
        seed = digest
    return out


def group_hash(page_hash: int, group: int) -> int:
    """The name of page group `group`'s page of the tokens that `page_hash` names (capped
    chunked layers, shared/kv/chunk_cache.py): a hash of both, no full layers' page name."""
    data = page_hash.to_bytes(HASH_BYTES, "little") + struct.pack("<I", group)
    digest = hashlib.blake2b(data, digest_size=HASH_BYTES, person=b"page group").digest()
    return int.from_bytes(digest, "little")
