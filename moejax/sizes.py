"""Powers of two: the few sizes that compiled programs see (a batch, a cache, a block
count rounded up to one of them), so a new request length rarely means a new program.
Every such rounding in ``moejax`` goes through here.
"""

from __future__ import annotations


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def prev_power_of_two(n: int) -> int:
    """The largest power of two <= ``n`` (1 for n <= 1)."""
    return 1 << (max(1, int(n)).bit_length() - 1)


def bucket(n: int, minimum: int, maximum: int | None = None) -> int:
    """The power of two >= max(n, minimum), capped at ``maximum`` (but never below n):
    every shape the compiled programs see is one of few sizes."""
    size = next_power_of_two(max(n, minimum, 1))
    if maximum is not None:
        size = max(min(size, maximum), n)
    return size


def bucket_sizes(most: int, maximum: int | None = None) -> list[int]:
    """Every size :func:`bucket` (minimum 1) gives for 1 .. ``most``: the shapes to
    precompile."""
    return sorted({bucket(n, 1, maximum) for n in range(1, most + 1)})
