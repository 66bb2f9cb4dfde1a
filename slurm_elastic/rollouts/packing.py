"""Which queued groups make the next batch: whole groups summing to exactly ``batch_size``,
taking the oldest ones that can be part of such a batch (pure; no I/O).

"Oldest first" means: going from the head, a group is taken whenever the batch can still be
completed from the groups after it. A group that fits with nothing in the window is passed
over, not waited for, and is taken by the first pull whose window completes a batch with it.
"""

from __future__ import annotations

from collections.abc import Iterable


def oldest_exact_batch(sizes: Iterable[int], batch_size: int) -> list[int] | None:
    """Positions (ascending) of the groups, among ``sizes`` (sequences per group, oldest first),
    that make a batch of exactly ``batch_size`` sequences preferring the oldest groups; None if
    no subset sums to it.

    First one pass from the head taking each group that fits; when that fills the batch it is
    the answer (each group it took completes, each one it passed was too big) and ``sizes`` is
    read no further. Otherwise a subset-sum over everything read: ``reach[i]`` is the set of
    sums (up to ``batch_size``, as the bits of an int) that groups ``i..`` can make, and a walk
    from the head takes group ``i`` when what is still needed after it is in ``reach[i + 1]``.
    O(groups x batch_size / 64) word operations."""
    read: list[int] = []
    taken: list[int] = []
    need = batch_size
    for n_seqs in sizes:
        if n_seqs < 1:
            raise ValueError(f"a group holds at least one sequence, not {n_seqs}")
        if n_seqs <= need:
            taken.append(len(read))
            need -= n_seqs
            if need == 0:
                return taken
        read.append(n_seqs)
    return _subset_sum(read, batch_size)


def _subset_sum(sizes: list[int], batch_size: int) -> list[int] | None:
    mask = (1 << (batch_size + 1)) - 1
    reach = [0] * (len(sizes) + 1)
    reach[-1] = 1  # the empty set makes 0
    for i in range(len(sizes) - 1, -1, -1):
        reach[i] = (reach[i + 1] | (reach[i + 1] << sizes[i])) & mask
    if not reach[0] >> batch_size & 1:
        return None
    taken: list[int] = []
    need = batch_size
    for i, n_seqs in enumerate(sizes):
        if n_seqs <= need and reach[i + 1] >> (need - n_seqs) & 1:
            taken.append(i)
            need -= n_seqs
            if need == 0:
                break
    return taken
