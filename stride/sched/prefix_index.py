"""The prefix index: content address -> physical block, for computed full blocks that are live or cached."""

from __future__ import annotations

import numpy as np

from stride.sched.prefix_hash import TOKEN_DTYPE, block_hash


class PrefixIndex:
    """Maps each address to at most one block and each block to at most one address, both ways.

    The block manager adds a block once ``mark_computed`` covers it and removes it only when it evicts the
    block; so an indexed block is always live or cached, never free. ``version`` changes with every add or
    remove, so a lookup result can be reused while the version is unchanged. ``indexed`` mirrors
    ``address(b) is not None`` as a bool array, for vector reads when many blocks are freed at once."""

    __slots__ = ("_by_address", "_address_of", "indexed", "version")

    def __init__(self, num_blocks: int) -> None:
        self._by_address: dict[bytes, int] = {}
        self._address_of: list[bytes | None] = [None] * num_blocks
        self.indexed = np.zeros(num_blocks, dtype=bool)
        self.version = 0

    def __len__(self) -> int:
        return len(self._by_address)

    def address(self, block_id: int) -> bytes | None:
        return self._address_of[block_id]

    def by_address(self) -> dict[bytes, int]:
        """The map address -> block itself (read it, do not change it: for the invariant checks)."""
        return self._by_address

    def addresses(self) -> list[bytes | None]:
        """The address of each block, None where it has none (read only, likewise)."""
        return self._address_of

    def match(self, seed: bytes, tokens: np.ndarray, block_size: int,
              known: list[bytes]) -> tuple[list[int], bytes, list[bytes]]:
        """The longest chain of indexed blocks holding ``tokens``' leading full blocks, never the block of
        its last token (recomputed so the model yields logits); the address the chain ends on; and every
        address computed or taken from ``known`` (the addresses of the leading blocks, already known)."""
        by_address = self._by_address
        step = block_size * TOKEN_DTYPE.itemsize
        data = tokens.tobytes()
        num_candidates = (len(tokens) - 1) // block_size
        hashes = known[:num_candidates]
        # The known addresses are looked up at C speed (map); the chain stops at the first miss.
        found = list(map(by_address.get, hashes))
        if None in found:
            num_hits = found.index(None)
            hits: list[int] = found[:num_hits]  # type: ignore[assignment]  # no None before num_hits
            return hits, hashes[num_hits - 1] if num_hits else seed, hashes
        hits = found  # type: ignore[assignment]  # no None
        h = hashes[-1] if hashes else seed
        for i in range(len(hashes), num_candidates):
            nh = block_hash(h, data[i * step:(i + 1) * step])
            hashes.append(nh)
            b = by_address.get(nh)
            if b is None:
                break
            hits.append(b)
            h = nh
        return hits, h, hashes

    def add(self, block_id: int, address: bytes) -> None:
        """Block ``block_id`` is computed and has ``address``: index it unless that content already is."""
        known = self._address_of[block_id]
        if known is not None:  # shared by a fork and indexed through the other sequence
            if known != address:
                raise AssertionError(f"block {block_id} has address {known.hex()}, now {address.hex()}")
        elif address not in self._by_address:
            self._by_address[address] = block_id
            self._address_of[block_id] = address
            self.indexed[block_id] = True
            self.version += 1
        # else: the same content was computed twice (two requests admitted together); this copy stays
        # unindexed and goes to the free list when released.

    def add_many(self, block_ids: list[int], addresses: list[bytes]) -> None:
        """:meth:`add` for each pair, in one loop."""
        by_address, address_of = self._by_address, self._address_of
        new: list[int] = []
        for b, h in zip(block_ids, addresses, strict=True):
            known = address_of[b]
            if known is not None:
                if known != h:
                    raise AssertionError(f"block {b} has address {known.hex()}, now {h.hex()}")
            elif by_address.setdefault(h, b) == b:  # one probe; b is in no entry yet (its address is None)
                address_of[b] = h
                new.append(b)
        if new:
            self.indexed[new] = True
            self.version += 1

    def remove_many(self, block_ids: list[int]) -> None:
        """Forget evicted blocks (each must be indexed)."""
        by_address, address_of = self._by_address, self._address_of
        for b in block_ids:
            del by_address[address_of[b]]  # type: ignore[arg-type]
            address_of[b] = None
        self.indexed[block_ids] = False
        self.version += 1
