"""The merge loop both tokenizers share: adjacent symbols joined, best pair first.

llama.cpp's SPM and BPE tokenizers pop the best pair from a work queue, ties leftmost. Here the
pairs' priorities sit in a list that each merge updates at its two new pairs only; the best pair
is the list's minimum (list.index gives the leftmost)."""
from __future__ import annotations


def merge_adjacent(syms: list, priority, never) -> list:
    """Merge `syms` in place, lowest priority(a, b) first, ties leftmost, until every adjacent
    pair's priority is `never` (no merge joins them). Returns `syms`."""
    pr = [priority(a, b) for a, b in zip(syms, syms[1:])]
    while pr:
        best = min(pr)
        if best == never:
            break
        at = pr.index(best)
        m = syms[at] + syms[at + 1]
        syms[at:at + 2] = [m]
        del pr[at]
        if at:
            pr[at - 1] = priority(syms[at - 1], m)
        if at < len(pr):
            pr[at] = priority(m, syms[at + 1])
    return syms
