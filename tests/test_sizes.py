"""The power-of-two roundings of ``moejax.sizes``, which every compiled shape goes through."""

from __future__ import annotations

from moejax.sizes import bucket, bucket_sizes, next_power_of_two, prev_power_of_two


def test_powers_of_two():
    assert [next_power_of_two(n) for n in (0, 1, 2, 3, 5, 8, 9)] == [1, 1, 2, 4, 8, 8, 16]
    assert [prev_power_of_two(n) for n in (0, 1, 2, 3, 5, 8, 9)] == [1, 1, 2, 2, 4, 8, 8]


def test_bucket_takes_the_minimum_and_caps_at_the_maximum_but_never_below_n():
    assert [bucket(n, 1) for n in (0, 1, 3, 16, 17)] == [1, 1, 4, 16, 32]
    assert [bucket(n, 16) for n in (1, 16, 17)] == [16, 16, 32]
    assert [bucket(n, 1, 24) for n in (5, 17, 24, 30)] == [8, 24, 24, 30]


def test_bucket_sizes_are_every_bucket_of_1_to_most():
    assert bucket_sizes(9) == [1, 2, 4, 8, 16]
    assert bucket_sizes(9, maximum=6) == [1, 2, 4, 6, 7, 8, 9]
    assert bucket_sizes(1) == [1] and bucket_sizes(0) == []
