import pytest

from diffrl.rollout import window_start


def test_random_window_is_in_range_deterministic_and_moves_with_the_step():
    starts = [window_start("random", 2, 9, 3, seed=5, step=s) for s in range(200)]
    assert set(starts) == set(range(2, 9 - 3 + 1))  # every legal start is reachable, nothing else
    assert starts == [window_start("random", 2, 9, 3, seed=5, step=s) for s in range(200)]
    assert starts != [window_start("random", 2, 9, 3, seed=6, step=s) for s in range(200)]


def test_progressive_window_slides_by_its_size_then_stops_at_the_end():
    # MixGRPO: k0 = min(lo + floor(step / iters_per_group) * W, hi - W)
    got = [window_start("progressive", 1, 10, 2, seed=0, step=s, iters_per_group=3) for s in range(18)]
    expected = [min(1 + (s // 3) * 2, 8) for s in range(18)]
    assert got == expected
    assert got[:9] == [1, 1, 1, 3, 3, 3, 5, 5, 5]


def test_window_errors():
    with pytest.raises(ValueError, match="does not fit"):
        window_start("random", 0, 4, 5, seed=0, step=0)
    with pytest.raises(ValueError, match="unknown window strategy 'sliding'"):
        window_start("sliding", 0, 4, 2, seed=0, step=0)
