"""Incremental prompts: the common prefix, found by slices, and the delta it makes."""

from __future__ import annotations

import random

from schemas.completion import common_prefix_length, delta_encode


def _naive(a: list[int], b: list[int]) -> int:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


def test_the_common_prefix_is_found_wherever_the_lists_part():
    rng = random.Random(7)
    base = [rng.randrange(150_000) for _ in range(3000)]
    # at the start, on a block's first and last id, mid-block, at the end, never
    for at in (0, 1, 511, 512, 513, 1023, 1024, 1500, 2999):
        other = base[:at] + [base[at] + 1] + base[at + 1 :]
        assert common_prefix_length(base, other) == _naive(base, other) == at
    assert common_prefix_length(base, base + [1, 2]) == 3000  # extended
    assert common_prefix_length(base + [1, 2], base) == 3000
    assert common_prefix_length(base, base) == 3000
    assert common_prefix_length([], base) == common_prefix_length(base, []) == 0
    for _ in range(200):  # short random lists against the id-at-a-time reading
        n = rng.randrange(0, 1200)
        a = [rng.randrange(4) for _ in range(n)]
        b = a[: rng.randrange(0, n + 1)] + [rng.randrange(4) for _ in range(rng.randrange(50))]
        assert common_prefix_length(a, b) == _naive(a, b)


def test_a_prompt_is_stored_as_a_reference_to_the_previous_call_and_its_tail():
    prev = list(range(1000))
    assert delta_encode(prev + [7, 8], (3, prev)) == (3, 1000, [7, 8])
    rewritten = prev[:600] + [5] * 10
    assert delta_encode(rewritten, (3, prev)) == (3, 600, [5] * 10)
    assert delta_encode(prev[:10] + [1], (3, prev)) == (None, 0, prev[:10] + [1])  # < 64
    assert delta_encode(prev, None) == (None, 0, prev)
