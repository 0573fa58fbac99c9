"""bench/numerics.py's bookkeeping on the CPU: the output-rounding floor and the verdict against FLA."""
import torch

from bench.numerics import OUTPUTS, floor_row, verdict


def test_floor_is_the_error_of_rounding_the_reference_to_each_outputs_dtype(gen):
    ref = {"o": torch.randn(4096, dtype=torch.float64, generator=gen),
           "dg": torch.randn(4096, dtype=torch.float64, generator=gen)}
    res = {"o": ref["o"].to(torch.bfloat16), "dg": ref["dg"].float()}
    floor = floor_row(res, ref)
    # bf16 keeps 8 significant bits: x in [2^e, 2^(e+1)) is rounded with an error uniform in +-2^(e-8), RMS
    # 2^(e-8) / sqrt(3), 1.13-2.26e-3 of x; over a normal sample's norm 1.6-1.7e-3
    assert 1.2e-3 < floor["o"] < 2.2e-3, floor
    assert floor["dg"] < 1e-7, floor  # fp32
    assert set(floor) == {"o", "dg"}


def row(case, arm, draw=None, **err):
    r = dict(suite="numerics", case=case, arm=arm, finite=all(v is not None for v in err.values()), **err)
    if draw is not None:
        r["draw"] = draw
    return r


def test_verdict_compares_each_draw_on_its_own_and_names_the_floor():
    rows = [row("c", "kda_aot", 0, dq=2.0e-3), row("c", "fla", 0, dq=3.0e-3), row("c", "floor/output-dtype", 0, dq=1e-3),
            row("c", "kda_aot", 1, dq=3.1e-3), row("c", "fla", 1, dq=3.0e-3), row("c", "floor/output-dtype", 1, dq=1e-3),
            row("d", "kda_aot", o=None), row("d", "fla", o=1e-3),
            row("e", "kda_aot", o=2e-3), row("e", "fla", o=None)]  # FLA not finite: nothing to compare
    worse, nonfinite = verdict(rows)
    assert worse == ["c#1:dq 3.1000e-03 > 3.0000e-03 (output rounding alone 1.00e-03)"]
    assert nonfinite == ["d"]
    assert "dq" in OUTPUTS
