"""Prompt-lookup drafts (services/rank/ngram_drafts.py) against a brute-force scan: the
longest suffix (max_n down to min_n) with an earlier occurrence that has a successor,
its latest such occurrence, the k tokens after it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.rank.ngram_drafts import NgramIndex


def scan(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    end = len(tokens)
    for n in range(min(max_n, end), min_n - 1, -1):
        gram = tokens[end - n:]
        for i in range(end - n - 1, -1, -1):  # latest first; i + n < end: a successor
            if tokens[i:i + n] == gram:
                return tokens[i + n:i + n + k]
    return []


@given(st.lists(st.integers(0, 5), max_size=60), st.integers(0, 6), st.integers(1, 5),
       st.integers(1, 5), st.integers(0, 59))
def test_the_index_proposes_what_a_scan_finds(tokens, k, a, b, cut):
    min_n, max_n = min(a, b), max(a, b)
    whole = NgramIndex(tokens, max_n=max_n, min_n=min_n)
    assert whole.propose(k) == scan(tokens, k, max_n, min_n)
    grown = NgramIndex(tokens[:cut], max_n=max_n, min_n=min_n)  # prompt, then output
    grown.extend(tokens[cut:])
    assert grown.propose(k) == whole.propose(k)
    back = NgramIndex(tokens, max_n=max_n, min_n=min_n)
    back.truncate(cut)
    assert back.propose(k) == scan(tokens[:cut], k, max_n, min_n)


def test_an_edit_returns_the_rest_of_the_quoted_line():
    prompt = [7, 1, 2, 3, 4, 5, 6, 9]  # "... the file ..."
    idx = NgramIndex(prompt + [1, 2])  # the answer starts quoting it
    assert idx.propose(3) == [3, 4, 5]
    idx.extend([3, 4, 5])
    # on past the quote into what followed it: the answer so far; no more than is there
    assert idx.propose(9) == [6, 9, 1, 2, 3, 4, 5]


def test_the_longest_matching_suffix_wins_over_a_later_shorter_one():
    # [2, 3] occurs last at the end of "8 2 3 5", but [1, 2, 3] only before 4
    idx = NgramIndex([1, 2, 3, 4, 8, 2, 3, 5, 1, 2, 3])
    assert idx.propose(1) == [4]
    assert NgramIndex([1, 2, 3, 4, 8, 2, 3, 5, 1, 2, 3], max_n=2).propose(1) == [5]


def test_no_match_and_no_room_propose_nothing():
    assert NgramIndex([1, 2, 3, 4]).propose(4) == []
    assert NgramIndex([1, 2, 1, 2]).propose(0) == []
    assert NgramIndex([]).propose(3) == []
    with pytest.raises(ValueError):
        NgramIndex(min_n=3, max_n=2)
