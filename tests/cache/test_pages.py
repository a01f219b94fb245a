"""Page arithmetic helpers against brute force."""

from __future__ import annotations

import math

from radixlm.cache.pages import align_down, align_up, div_ceil


def test_page_helpers_match_brute_force() -> None:
    for page in (1, 2, 3, 16):
        for n in range(0, 100):
            assert div_ceil(n, page) == math.ceil(n / page)
            assert align_down(n, page) == max(k for k in range(0, n + 1, page))
            assert align_up(n, page) == min(k for k in range(0, n + page, page) if k >= n)
