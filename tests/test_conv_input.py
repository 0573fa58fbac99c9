"""Bad input to causal_conv1d_silu: a clear TypeError/ValueError naming the argument, before any launch.

Runs without a GPU: the bindings check dtype, shape, strides and alignment before the device,
so CPU tensors reach every check, and the device check itself is the last one.
"""
import pytest
import torch

from conftest import HAS_GPU
from kda_aot import causal_conv1d_silu
from kda_aot._runtime import registry
from kda_aot._runtime.tensor import describe
from kda_aot.ops.conv import conv1d_silu_backward, conv1d_silu_forward

DEV = "cuda" if HAS_GPU else "cpu"


def good(T=12, D=16, N=2, device=DEV):
    x = torch.randn(1, T, D, dtype=torch.bfloat16, device=device)
    w = torch.randn(D, 4, device=device)
    b = torch.randn(D, device=device)
    cu = torch.tensor([0, 5, T], dtype=torch.int32, device=device)
    halo = torch.randn(N, 3, D, dtype=torch.bfloat16, device=device)
    return x, w, b, cu, halo


CASES = [
    ("x dtype", lambda x, w, b, cu, h: (x.float(), w, b, cu, h), TypeError, "x: expected dtype bfloat16"),
    ("x rank", lambda x, w, b, cu, h: (x[0], w, b, cu, h), ValueError, r"x: expected shape \[1, T, D\]"),
    ("x batch", lambda x, w, b, cu, h: (x.expand(2, -1, -1), w, b, cu, h), ValueError, "x: expected shape"),
    ("x D not multiple of 8", lambda x, w, b, cu, h: (x[..., :12], w[:12], b[:12], cu, h[..., :12]), ValueError,
     "x: D must be a positive multiple of 8"),
    ("weight width", lambda x, w, b, cu, h: (x, torch.randn(w.shape[0], 3, device=w.device), b, cu, h), ValueError,
     r"weight: expected shape \[D, 4\]"),
    ("weight D mismatch", lambda x, w, b, cu, h: (x, torch.randn(8, 4, device=w.device), b, cu, h), ValueError,
     "weight: expected shape"),
    ("weight 3d", lambda x, w, b, cu, h: (x, w[:, None, :], b, cu, h), ValueError, r"weight: expected shape \[D, 4\]"),
    ("weight dtype", lambda x, w, b, cu, h: (x, w.to(torch.int32), b, cu, h), TypeError,
     "weight: expected a floating-point dtype"),
    ("bias dtype", lambda x, w, b, cu, h: (x, w, b.to(torch.int64), cu, h), TypeError,
     "bias: expected a floating-point dtype"),
    ("bias shape", lambda x, w, b, cu, h: (x, w, b[:8], cu, h), ValueError, r"bias: expected shape \[D\]"),
    ("halo shape", lambda x, w, b, cu, h: (x, w, b, cu, h[:1]), ValueError, r"halo: expected shape \[N, 3, D\]"),
    ("halo dtype", lambda x, w, b, cu, h: (x, w, b, cu, h.float()), TypeError, "halo: expected dtype bfloat16"),
    ("cu dtype", lambda x, w, b, cu, h: (x, w, b, cu.float(), h), TypeError, "cu_seqlens: expected dtype int32 or int64"),
    ("cu decreasing", lambda x, w, b, cu, h: (x, w, b, torch.tensor([0, 7, 3, 12], dtype=torch.int32), h),
     ValueError, "cu_seqlens: must be non-decreasing"),
    ("cu end", lambda x, w, b, cu, h: (x, w, b, torch.tensor([0, 5, 11], dtype=torch.int32), h), ValueError,
     "cu_seqlens: must end at T = 12"),
    ("cu start", lambda x, w, b, cu, h: (x, w, b, torch.tensor([1, 5, 12], dtype=torch.int32), h), ValueError,
     "cu_seqlens: must start at 0"),
    ("cu rank", lambda x, w, b, cu, h: (x, w, b, cu[None], h), ValueError, r"cu_seqlens: expected shape \[N \+ 1\]"),
    # a list of ints is boundaries, as for chunk_kda and PackedKDA: its values are checked the same way
    ("cu list end", lambda x, w, b, cu, h: (x, w, b, [0, 5, 11], h), ValueError, "cu_seqlens: must end at T = 12"),
    ("cu list floats", lambda x, w, b, cu, h: (x, w, b, [0, 5.5, 12], h), TypeError,
     "cu_seqlens: expected a tensor or a sequence of ints"),
    ("x not a tensor", lambda x, w, b, cu, h: (x.tolist(), w, b, cu, h), TypeError, "x: expected a torch.Tensor"),
]
# With no token (T = 0) no binding runs, and bad input is still named.
EMPTY = lambda x, cu: (x[:, :0], torch.zeros_like(cu))  # noqa: E731
CASES += [
    ("empty x dtype", lambda x, w, b, cu, h: (EMPTY(x, cu)[0].float(), w, b, EMPTY(x, cu)[1], h), TypeError,
     "x: expected dtype bfloat16"),
    ("empty x D", lambda x, w, b, cu, h: (EMPTY(x, cu)[0][..., :12], w[:12], b[:12], EMPTY(x, cu)[1], h), ValueError,
     "x: D must be a positive multiple of 8"),
    ("empty weight", lambda x, w, b, cu, h: (EMPTY(x, cu)[0], w[:8], b, EMPTY(x, cu)[1], h), ValueError,
     r"weight: expected shape \[D, 4\]"),
    ("empty bias", lambda x, w, b, cu, h: (EMPTY(x, cu)[0], w, b[:8], EMPTY(x, cu)[1], h), ValueError,
     r"bias: expected shape \[D\]"),
]


@pytest.mark.parametrize("name,mutate,exc,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_named(name, mutate, exc, match):
    x, w, b, cu, h = mutate(*good())
    with pytest.raises(exc, match=match):
        causal_conv1d_silu(x, w, b, cu_seqlens=cu, halo=h)


def test_misaligned_storage_is_named_by_the_binding():
    """The binding's own check (on the GPU behind every call; on the CPU the kernel call reaches it)."""
    x, w, b, cu, h = good()
    x = torch.randn(x.numel() + 1, device=x.device).to(torch.bfloat16)[1:].view(x.shape)
    if HAS_GPU:
        with pytest.raises(ValueError, match="x: storage must be 16-byte aligned"):
            causal_conv1d_silu(x, w, b, cu_seqlens=cu, halo=h)
    with pytest.raises(ValueError, match="x: storage must be 16-byte aligned"):
        conv1d_silu_forward(x, w, b, cu, h)


@pytest.mark.skipif(HAS_GPU, reason="the CPU-tensor refusal is what a GPU-less machine can show")
def test_cpu_tensors_are_refused_after_every_other_check():
    """After the checks that need no kernel, the boundaries' values and the halo's rows among them, naming the
    reference's conv1d_silu (and the l2norm step), as chunk_kda names its counterpart."""
    x, w, b, cu, h = good()
    refusal = (r"x: causal_conv1d_silu runs its kernels on a CUDA GPU, got a tensor on cpu; on the CPU, "
               r"kda_aot.reference.conv1d_silu is the same math in fp64 \(with l2norm, apply kda_aot.reference.l2norm")
    with pytest.raises(ValueError, match=refusal):
        causal_conv1d_silu(x, w, b, cu_seqlens=cu, halo=h)
    with pytest.raises(ValueError, match=refusal):
        causal_conv1d_silu(x, w, b, cu_seqlens=[0, 5, 12], halo=h, l2norm=False)
    with pytest.raises(TypeError, match="l2norm: expected a bool, got 'no'"):  # not a true string
        causal_conv1d_silu(x, w, b, cu_seqlens=cu, halo=h, l2norm="no")
    empty = x[:, :0]  # no token: nothing to launch, and still refused (not an empty result)
    with pytest.raises(ValueError, match="x: causal_conv1d_silu runs its kernels on a CUDA GPU.*kda_aot.reference.conv1d_silu is the same"):
        causal_conv1d_silu(empty, w, b, cu_seqlens=torch.zeros(3, dtype=torch.int32), halo=h)


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
def test_mixed_devices_are_refused():
    x, w, b, cu, h = good()
    with pytest.raises(ValueError, match="weight: on cpu"):
        causal_conv1d_silu(x, w.cpu(), b, cu_seqlens=cu, halo=h)


def test_kernel_calls_refuse_views_and_empty_documents():
    """The kernel calls take contiguous tensors and no zero-length document; causal_conv1d_silu takes both."""
    from kda_aot.ops.conv import checked_boundaries, conv1d_silu_forward
    x, w, b, cu, h = good()
    with pytest.raises(ValueError, match="x: expected contiguous"):
        conv1d_silu_forward(x.transpose(1, 2).contiguous().transpose(1, 2), w, b, cu, h)
    with pytest.raises(ValueError, match="cu_seqlens: the conv kernel calls take no zero-length document"):
        checked_boundaries(x, w, b, None, torch.tensor([0, 5, 5, 12]))


def test_backward_binding_checks_outputs_and_workspace():
    x, w, b, cu, h = good()
    dy = torch.randn_like(x)
    with pytest.raises(ValueError, match=r"dweight: expected shape \[D, 4\]"):
        conv1d_silu_backward(x, w, b, cu, dy, h, out={"dweight": torch.empty(16, 3, device=x.device)})
    with pytest.raises(TypeError, match="dx: expected dtype bfloat16"):
        conv1d_silu_backward(x, w, b, cu, dy, h, out={"dx": torch.empty(x.shape, device=x.device)})
    with pytest.raises(ValueError, match=r"dhalo: expected shape \[N, 3, D\]"):
        conv1d_silu_backward(x, w, b, cu, dy, h, need_dhalo=True,
                             out={"dhalo": torch.empty(1, 3, 16, device=x.device)})
    lib = registry.library("conv1d_silu_bwd")
    args = [describe(t, n) for t, n in ((x, "x"), (w, "w"), (b, "b"), (h, "h"), (cu, "cu"), (dy, "dy"),
                                         (torch.empty_like(x), "dx"), (torch.empty_like(w), "dw"),
                                         (torch.empty_like(b), "db"), (None, "dh"))]
    small = torch.empty(8, device=x.device)
    with pytest.raises(ValueError, match="workspace: needs"):
        lib.launch(*args, describe(small, "ws"), 0)
    bias_free = list(args)
    bias_free[2] = None
    with pytest.raises(ValueError, match="dbias: given without bias"):
        lib.launch(*bias_free, describe(small, "ws"), 0)


def test_byte_size_overflow_is_refused():
    lib = registry.library("conv1d_silu_fwd")
    huge = (16, 1, -1, (1, 2 ** 62, 8), (8, 8, 1))  # 2**62 * 8 * 2 bytes
    with pytest.raises(ValueError, match="x: byte size overflows int64"):
        lib.launch(huge, None, None, None, None, None, 0)


def test_malformed_descriptor_is_a_type_error():
    lib = registry.library("conv1d_silu_fwd")
    with pytest.raises(TypeError, match="x: expected a tensor descriptor"):
        lib.launch((1, 2, 3), None, None, None, None, None, 0)
    with pytest.raises(TypeError, match="weight: a tensor is required"):
        x, *_ = good()
        lib.launch(describe(x, "x"), None, None, None, None, None, 0)


def test_l2norm_form_needs_whole_heads():
    """The fused-norm form normalises heads of 128 channels: any other D is refused before any launch."""
    x, w, b, cu, h = good(D=136)
    with pytest.raises(ValueError, match="D must be a multiple of 128"):
        causal_conv1d_silu(x, w, b, cu_seqlens=cu, halo=h, l2norm=True)
    with pytest.raises(TypeError, match="x: expected a torch.Tensor"):
        causal_conv1d_silu(x.tolist(), w, b, cu_seqlens=cu, halo=h, l2norm=True)


def test_l2norm_form_eps_is_the_norms():
    """The l2norm records bake in kda_aot.reference.L2NORM_EPS (the same norm as the separate l2norm kernel)."""
    from codegen.catalog import RECORDS
    from kda_aot.reference import L2NORM_EPS
    forms = [r for r in RECORDS if r.program.startswith("conv1d_silu") and r.params["l2norm"]]
    assert {r.program for r in forms} == {"conv1d_silu_fwd", "conv1d_silu_bwd"}
    for r in forms:
        assert float(r.params["l2norm_eps"].rstrip("f")) == L2NORM_EPS
        assert r.params["channels"] * 32 == 128  # one head per warp (static_assert in the template too)
