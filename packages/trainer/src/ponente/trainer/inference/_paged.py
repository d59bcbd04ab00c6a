"""The pages of a paged key/value cache on the host: allocation with reference counts, and the prefix cache.

:class:`PagePool` hands out page indices of a :class:`~ponente.models.PagedKvCache` pool. A sequence takes pages as
its tokens reach them and gives them back when it ends. With prefix caching, the full pages of a prompt are
registered under a hash of their token ids chained with those of the pages before them (so a page stands for the
whole prefix up to its end); a later prompt with the same prefix takes those pages (one more reference each) and
skips their prefill. A registered page nobody references stays cached until the pool needs it: then the least
recently used one is evicted.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

__all__ = ["PagePool", "prefix_hashes"]


def prefix_hashes(tokens: Sequence[int], page_size: int) -> list[int]:
    """The chained hash of each full page of ``tokens`` (page ``i``'s covers tokens ``0 .. (i + 1) * page_size``)."""
    hashes: list[int] = []
    previous = 0
    for start in range(0, len(tokens) - page_size + 1, page_size):
        previous = hash((previous, tuple(tokens[start : start + page_size])))
        hashes.append(previous)
    return hashes


class PagePool:
    """Page allocation with reference counts and an LRU prefix cache (host side, not thread-safe).

    Args:
        pages: the pages of the pool.
        prefix_caching: whether full prompt pages are kept and shared (:meth:`register`, :meth:`lookup`).

    Example:
        >>> pool = PagePool(4)
        >>> a = pool.allocate()
        >>> pool.register(123, a)
        >>> pool.release(a)  # unreferenced but cached: a later prompt with the same prefix takes it
        >>> pool.lookup([123]) == [a], pool.hits
        (True, 1)
    """

    def __init__(self, pages: int, *, prefix_caching: bool = True) -> None:
        self.pages = pages
        self.prefix_caching = prefix_caching
        self._free = list(range(pages - 1, -1, -1))
        self._refs = [0] * pages
        self._cached: collections.OrderedDict[int, int] = collections.OrderedDict()  # hash -> page, LRU first
        self._hash_of: dict[int, int] = {}  # page -> hash
        self.hits = 0
        """Pages taken from the prefix cache so far (prefill tokens skipped: ``hits * page_size``)."""
        self.evictions = 0
        """Cached pages evicted so far to make room."""

    @property
    def available(self) -> int:
        """Pages :meth:`allocate` can still hand out (free ones, and cached ones nobody references)."""
        return len(self._free) + sum(1 for page in self._cached.values() if self._refs[page] == 0)

    @property
    def in_use(self) -> int:
        """Pages referenced by at least one sequence."""
        return sum(1 for r in self._refs if r > 0)

    @property
    def cached(self) -> int:
        """Pages registered in the prefix cache (referenced or not)."""
        return len(self._cached)

    def allocate(self) -> int | None:
        """A page with one reference: a free one, else the least recently used unreferenced cached one; None if
        every page is referenced."""
        if self._free:
            page = self._free.pop()
        else:
            victim = next((h for h, p in self._cached.items() if self._refs[p] == 0), None)
            if victim is None:
                return None
            page = self._cached.pop(victim)
            del self._hash_of[page]
            self.evictions += 1
        self._refs[page] = 1
        return page

    def release(self, page: int) -> None:
        """Drop one reference to ``page``; an unreferenced page is freed unless the prefix cache holds it."""
        self._refs[page] -= 1
        if self._refs[page] == 0 and page not in self._hash_of:
            self._free.append(page)

    def register(self, prefix_hash: int, page: int) -> None:
        """Record that ``page`` holds the full page of a prompt whose prefix hashes to ``prefix_hash``."""
        if not self.prefix_caching or prefix_hash in self._cached or page in self._hash_of:
            return
        self._cached[prefix_hash] = page
        self._hash_of[page] = prefix_hash

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """The cached pages of the longest cached prefix of ``hashes``, each with one more reference."""
        found: list[int] = []
        if not self.prefix_caching:
            return found
        for prefix_hash in hashes:
            page = self._cached.get(prefix_hash)
            if page is None:
                break
            self._cached.move_to_end(prefix_hash)
            self._refs[page] += 1
            found.append(page)
        self.hits += len(found)
        return found

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (pages still referenced stay with their sequences); returns how many were
        cached."""
        n = len(self._cached)
        for page in self._cached.values():
            del self._hash_of[page]
            if self._refs[page] == 0:
                self._free.append(page)
        self._cached.clear()
        return n
