"""Hashes of the precomputed-beta call's outputs and gradients (bf16 beta, gate precomputed and in kernel, both
backward modes), for patch_ab.sh's cmd step: cmd_A_*.log and cmd_B_*.log must be equal (the patch leaves the
precomputed path bitwise unchanged). Uses only what both trees have."""
import hashlib

import torch

import kda_aot

torch.manual_seed(0)
lens, H = [1, 63, 64, 65, 700, 37], 4
T, D = sum(lens), 128
cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).cuda()
x = {"q": torch.randn(1, T, H, D).bfloat16(), "k": torch.randn(1, T, H, D).bfloat16(),
     "v": torch.randn(1, T, H, D).bfloat16(), "g": torch.randn(1, T, H, D), "b": torch.rand(1, T, H).bfloat16(),
     "h0": torch.randn(len(lens), H, D, D) * 0.1, "A_log": torch.rand(H), "dt_bias": torch.randn(H * D)}
x = {n: t.cuda() for n, t in x.items()}
do, dht = torch.randn(1, T, H, D).bfloat16().cuda(), torch.randn(len(lens), H, D, D).cuda()


def digest(t):
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]


for gate_in_kernel in (False, True):
    for mode in ("replay", "saved"):
        leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
        g = leaves["g"] if gate_in_kernel else -torch.nn.functional.softplus(leaves["g"])
        extra = dict(A_log=leaves["A_log"], dt_bias=leaves["dt_bias"]) if gate_in_kernel else {}
        o, s = kda_aot.chunk_kda(leaves["q"], leaves["k"], leaves["v"], g, leaves["b"], None, leaves["h0"], True, True,
                                 gate_in_kernel, False, cu_seqlens=cu, backward=mode, **extra)
        torch.autograd.backward((o, s), (do, dht))
        grads = {n: t.grad for n, t in leaves.items() if t.grad is not None}
        print(f"bits gate_in_kernel={gate_in_kernel} {mode}: o {digest(o)} s {digest(s)} " +
              " ".join(f"d{n} {digest(t)}" for n, t in sorted(grads.items())))
