"""`mhgpo reproduce`'s own checks before any row runs (the rows themselves: tests/experiments)."""

from __future__ import annotations

from mhgpo.cli.reproduce import oversubscribed


def test_more_rows_than_cores_under_the_cpu_clock_is_warned_of() -> None:
    warning = oversubscribed(3, "cpu", 2)
    assert warning is not None
    assert "--parallel 3" in warning and "2 cores" in warning and "fewer steps" in warning


def test_one_row_to_a_core_or_the_wall_clock_is_not_warned_of() -> None:
    assert oversubscribed(2, "cpu", 2) is None
    assert oversubscribed(1, "cpu", 2) is None
    assert oversubscribed(8, "wall", 2) is None  # wall time: a shared core shortens training, as the clock says
