"""The benchmarks' interleaving (CPU): every arm once per round, the order reversed every other round."""
import torch

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


def test_bits_compare_sees_one_flipped_bit_and_not_nan_or_zero_signs(tmp_path, capsys):
    """bench/bits.py, the check of a bitwise-claimed change: equal saves compare equal even with NaN and -0 (bits,
    not values), and one flipped low bit of one bf16 element is named."""
    from bench.bits import compare
    x = torch.tensor([1.0, float("nan"), -0.0, 3.0])
    y = x.to(torch.bfloat16)
    a = {"case/replay": {"dg": x.clone(), "dq": y.clone()}}
    torch.save(a, tmp_path / "a.pt")
    torch.save(a, tmp_path / "b.pt")
    assert compare(tmp_path / "a.pt", tmp_path / "b.pt") == 0
    flipped = y.clone()
    flipped.view(torch.int16)[3] ^= 1
    torch.save({"case/replay": {"dg": x.clone(), "dq": flipped}}, tmp_path / "c.pt")
    assert compare(tmp_path / "a.pt", tmp_path / "c.pt") == 1
    assert "differ: case/replay/dq" in capsys.readouterr().out
    zero_sign = x.clone()
    zero_sign[2] = 0.0
    torch.save({"case/replay": {"dg": zero_sign, "dq": y.clone()}}, tmp_path / "d.pt")
    assert compare(tmp_path / "a.pt", tmp_path / "d.pt") == 1
