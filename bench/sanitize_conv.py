"""Small conv1d + SiLU forward/backward run for compute-sanitizer (memcheck, racecheck).

Documents of length 1..4, 63..65 and a longer one, halo in and out, both cu_seqlens dtypes,
shipped and (when built) test-only forms; the l2norm forms (q and k with the per-head norm fused:
warp shuffles in the row loop) on D = 256, two heads.
"""
import torch

from kda_aot._runtime import registry
from kda_aot.ops.conv import conv1d_silu_backward, conv1d_silu_forward

lens = [1, 2, 3, 4, 63, 64, 65, 700]
T = sum(lens)


def inputs(D):
    x = torch.randn(1, T, D, device="cuda").to(torch.bfloat16)
    w, b = torch.randn(D, 4, device="cuda"), torch.randn(D, device="cuda")
    halo = torch.randn(len(lens), 3, D, device="cuda").to(torch.bfloat16)
    return x, w, b, halo, torch.randn_like(x)


forms = ["default", "l2norm"]
try:
    registry.library("conv1d_silu_fwd", "short_tiles")
    registry.library("conv1d_silu_bwd", "short_tiles")
    forms.append("short_tiles")
except registry.RecordError:
    pass
for form in forms:
    x, w, b, halo, dy = inputs(256 if form == "l2norm" else 136)
    for cu_dtype in (torch.int32, torch.int64):
        cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(cu_dtype)
        for h in (None, halo):
            conv1d_silu_forward(x, w, b, cu, h, form=form)
            conv1d_silu_backward(x, w, b, cu, dy, h, need_dhalo=h is not None, form=form)
torch.cuda.synchronize()
print("sanitize_conv: ran", forms)
