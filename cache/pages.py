"""Page arithmetic, written once: token counts to pages and page-aligned lengths.

Every layer that sizes or aligns by pages (allocator, prefix cache, scheduler, model
runner, benchmarks) calls these instead of spelling `-(-n // p)` or `n // p * p` again.
"""

from __future__ import annotations


def div_ceil(n: int, d: int) -> int:
    """Smallest integer >= n / d (d > 0): pages needed for n tokens."""
    return -(-n // d)


def align_down(n: int, page: int) -> int:
    """The largest multiple of `page` that is <= n: the page-aligned part of n tokens."""
    return n - n % page


def align_up(n: int, page: int) -> int:
    """The smallest multiple of `page` that is >= n: n tokens rounded up to whole pages."""
    return div_ceil(n, page) * page
