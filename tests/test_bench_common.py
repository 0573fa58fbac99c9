"""The benchmarks' interleaving (CPU): every arm once per round, the order reversed every other round."""
from bench.common import round_order


def test_round_order_alternates_and_covers_every_arm():
    arms = {"kda_aot": None, "kda_aot@full": None, "fla": None}
    assert round_order(arms, 0) == ["kda_aot", "kda_aot@full", "fla"]
    assert round_order(arms, 1) == ["fla", "kda_aot@full", "kda_aot"]
    assert round_order(arms, 2) == round_order(arms, 0)
    # over any two consecutive rounds each arm is timed twice and follows a different arm each time
    # (or starts a round): no arm always runs right after the same other arm
    for i in range(4):
        a, b = round_order(arms, i), round_order(arms, i + 1)
        assert sorted(a) == sorted(b) == sorted(arms)
        before_a = {x: a[j - 1] if j else None for j, x in enumerate(a)}
        before_b = {x: b[j - 1] if j else None for j, x in enumerate(b)}
        assert all(before_a[x] != before_b[x] or before_a[x] is None for x in arms)
