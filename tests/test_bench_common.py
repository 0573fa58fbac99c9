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


_SASS = """
//--------------------- .text._ZN59_GLOBAL__N__674c4a9b_26_51f0f3e9496cd614_kernel_cu_1e946f3e13kda_fwd_chunkEv ----
	.section	.text._ZN59_GLOBAL__N__674c4a9b_26_51f0f3e9496cd614_kernel_cu_1e946f3e13kda_fwd_chunkEv,"ax",@progbits
.text._ZN59_GLOBAL__N__674c4a9b_26_51f0f3e9496cd614_kernel_cu_1e946f3e13kda_fwd_chunkEv:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/               @P1 MUFU.EX2 R12, R13 ;
.L_x_0:
        /*0020*/                   MUFU.LG2 R27, R27 ;
        /*0030*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0040*/                   RET.REL.NODEC R6 `(_ZN59_GLOBAL__N__674c4a9b_26_51f0f3e9496cd614_kernel_cu_1e946f3e13kda_fwd_chunkEv) ;
"""


def test_sass_parse_keys_kernels_without_their_unit_and_counts_opcodes():
    """bench/sass.py, the check that a template change left machine code alone: a kernel is named without its
    unit's file name (which every re-hash changes), instructions lose their addresses, and the opcode counts
    ignore predicates and modifiers; the same kernel from another unit parses equal, a changed one does not."""
    from bench.sass import opcode_counts, parse_sass
    k = parse_sass(_SASS)
    assert list(k) == ["_ZN59<unit>13kda_fwd_chunkEv"]
    assert k["_ZN59<unit>13kda_fwd_chunkEv"][1] == "@P1 MUFU.EX2 R12, R13"
    c = opcode_counts(k["_ZN59<unit>13kda_fwd_chunkEv"])
    assert (c["MUFU"], c["HMMA"], c["LDC"], sum(c.values())) == (2, 1, 1, 5)
    other_unit = _SASS.replace("51f0f3e9496cd614", "0123456789abcdef").replace("674c4a9b", "deadbeef")
    assert parse_sass(other_unit) == k
    assert parse_sass(_SASS.replace("MUFU.LG2 R27", "MUFU.LG2 R28")) != k
