"""The bits of fixed-seed training calls, to check a change that claims to leave every output bitwise as it
was (two trees, one GPU: bench/patch_ab.sh's `bits` step):

    python3 bench/bits.py save FILE       every output and gradient of the calls below, on this tree's kernels
    python3 bench/bits.py compare A B     which tensors differ between two saves (exit 1 if any does)

The calls: chunk_kda through autograd on a small pack (documents 1, 63, 64, 65, 130, 700 and 2 tokens, H = 4), with
an initial state and final-state gradients, both backward modes, on the log decay (some of it below the kernels'
floor, one reset) and on raw gates activated in the kernels (softplus of a bf16 and of an fp32 raw gate, sigmoid
with lower_bound on a bf16 raw gate and on an fp32 one without A_log and dt_bias, beta's logits in bf16 and fp32).
The inputs are fixed (seeded), not fresh: the same tensors must reach both trees.
"""
import sys

import torch

LENS = [1, 63, 64, 65, 130, 700, 2]
H, D = 4, 128


def _calls():
    from kda_aot import chunk_kda

    gen = torch.Generator(device="cuda").manual_seed(1234)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", generator=gen) * scale

    T, N = sum(LENS), len(LENS)
    cu = torch.tensor([0] + LENS).cumsum(0).to(torch.int32)
    q = torch.nn.functional.normalize(randn(1, T, H, D), dim=-1).to(torch.bfloat16)
    k = torch.nn.functional.normalize(randn(1, T, H, D), dim=-1).to(torch.bfloat16)
    v = randn(1, T, H, D).to(torch.bfloat16)
    h0 = randn(N, H, D, D, scale=0.1)
    do, dht = randn(1, T, H, D).to(torch.bfloat16), randn(N, H, D, D, scale=0.1)
    log_decay = -5 * torch.rand(1, T, H, D, device="cuda", generator=gen)
    log_decay[..., :16] *= 8  # a slice below the kernels' floor of -20, and a reset
    log_decay[0, 100, 1, 3] = float("-inf")
    beta = torch.rand(1, T, H, device="cuda", generator=gen).to(torch.bfloat16)
    raw, logits = randn(1, T, H, D, scale=4), randn(1, T, H)
    a_log, dt_bias = randn(H) + 1, randn(H * D)
    cases = {
        "log_decay": (log_decay, beta, {}),
        "softplus_bf16": (raw.to(torch.bfloat16), logits.to(torch.bfloat16),
                          dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, A_log=a_log, dt_bias=dt_bias)),
        "softplus_fp32": (raw, logits, dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                            allow_neg_eigval=True, A_log=a_log, dt_bias=dt_bias)),
        "sigmoid_bf16": (raw.to(torch.bfloat16), beta, dict(use_gate_in_kernel=True, safe_gate=True,
                                                            lower_bound=-3.0, A_log=a_log, dt_bias=dt_bias)),
        "sigmoid_fp32_no_a_log": (raw, beta, dict(use_gate_in_kernel=True, lower_bound=-5.0)),
    }
    for name, (g, b, kw) in cases.items():
        for mode in ("replay", "saved"):
            leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, b, h0)]
            extra = {key: (x.detach().clone().requires_grad_() if torch.is_tensor(x) else x) for key, x in kw.items()}
            o, ht = chunk_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu,
                              backward=mode, **extra)
            torch.autograd.backward([o, ht], [do, dht])
            out = {"o": o.detach(), "final_state": ht.detach()}
            for key, x in zip(("q", "k", "v", "g", "beta", "initial_state"), leaves):
                out["d" + key] = x.grad
            for key, x in extra.items():
                if torch.is_tensor(x):
                    out["d" + key] = x.grad
            yield f"{name}/{mode}", out


def save(path):
    torch.save({case: {key: x.cpu() for key, x in out.items()} for case, out in _calls()}, path)
    print(f"bits: saved {path}")


_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def same_bits(x, y) -> bool:
    """x and y hold the same bits (NaN payloads and the sign of zero included)."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    as_bits = _BITS.get(x.dtype)
    return torch.equal(x.view(as_bits), y.view(as_bits)) if as_bits is not None else torch.equal(x, y)


def compare(path_a, path_b) -> int:
    a, b = torch.load(path_a), torch.load(path_b)
    differ = [f"{case}/{key}" for case in sorted(set(a) | set(b)) for key in sorted(set(a.get(case, {})) |
                                                                                    set(b.get(case, {})))
              if key not in a.get(case, {}) or key not in b.get(case, {}) or not same_bits(a[case][key], b[case][key])]
    n = len({(case, key) for d in (a, b) for case, out in d.items() for key in out})
    print(f"bits: {n - len(differ)} of {n} tensors bitwise equal" + (f"; differ: {', '.join(differ)}" if differ else ""))
    return 1 if differ else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "save":
        save(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
