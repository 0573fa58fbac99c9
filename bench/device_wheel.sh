#!/usr/bin/env bash
# One device call (nvidia-h200): the wheel as a user gets it.
#   1. `pip wheel` of the checkout (shipped records, 16 jobs)
#   2. a fresh venv outside the checkout with only the wheel installed; it sees the device's torch (and the
#      carried FLA wheels in /tmp/site) through a .pth, the machine having no network
#   3. from /tmp: FLA's layer call as training code makes it (q, k, v views of one fused projection, the raw bf16
#      gate x 8 with A_log and dt_bias so that g reaches -30, beta logits, q and k L2-normalised in the call, documents of
#      1, 63, 64, 65 and 2,000 tokens), eager and under torch.compile, `o.sum().backward()`: finite, and the
#      compiled gradients bitwise the eager ones
#   3b. FLA's KimiDeltaAttention layer with `import kda_aot.fla` from the installed wheel: its chunk_kda and convs
#      served (counted), outputs and gradients against FLA's own kernels
#   4. tests/test_installed.py, tests/test_ops_gpu.py and tests/test_readme.py (the README's examples) against the
#      installed package (KDA_AOT_TEST_INSTALLED=1)
# Logs in $OUT (wheel.log, user_call.log, user_fla_layer.log, pytest_installed.log).
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
ROOT=$PWD
rm -rf /tmp/dist /tmp/user_venv
KDA_AOT_JOBS=16 python3 -m pip wheel . --no-build-isolation --no-deps -q -w /tmp/dist > "$OUT/wheel.log" 2>&1 \
  || { tail -20 "$OUT/wheel.log"; exit 1; }
WHEEL=$(ls /tmp/dist/kda_aot-*.whl)
stamp "wheel: $WHEEL"
python3 -m venv /tmp/user_venv
TORCH_SITE=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
VENV_SITE=$(/tmp/user_venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$TORCH_SITE" > "$VENV_SITE/device_torch.pth"
/tmp/user_venv/bin/python -m pip install -q --no-deps --no-index "$WHEEL" >> "$OUT/wheel.log" 2>&1 || { tail -5 "$OUT/wheel.log"; exit 1; }
stamp "installed into /tmp/user_venv"
cat > /tmp/user_call.py <<'PY'
import torch
import kda_aot

assert "/tmp/user_venv/" in kda_aot.__file__, kda_aot.__file__
print("kda_aot", kda_aot.__version__, "from", kda_aot.__file__)
H, D = 4, 128
lens = [1, 63, 64, 65, 2000]
T = sum(lens)
cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
gen = torch.Generator(device="cuda").manual_seed(0)
proj = (torch.randn(1, T, 3 * H * D, device="cuda", generator=gen) * 2).to(torch.bfloat16).requires_grad_()
raw = (torch.randn(1, T, H, D, device="cuda", generator=gen) * 8).to(torch.bfloat16).requires_grad_()
logits = torch.randn(1, T, H, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
a_log = torch.log(torch.rand(H, device="cuda", generator=gen) * 15 + 1).requires_grad_()
dt_bias = (0.1 * torch.randn(H * D, device="cuda", generator=gen)).requires_grad_()
leaves = (proj, raw, logits, a_log, dt_bias)


def step(fn):
    for x in leaves:
        x.grad = None
    o = fn(proj, raw, logits, a_log, dt_bias)
    o.sum().backward()
    return o.detach(), [x.grad.clone() for x in leaves]


def call(proj, raw, logits, a_log, dt_bias):
    q, k, v = (t.view(1, T, H, D) for t in proj.split(H * D, dim=-1))
    return kda_aot.chunk_kda(q, k, v, raw, logits, A_log=a_log, dt_bias=dt_bias, cu_seqlens=cu,
                             use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                             use_beta_sigmoid_in_kernel=True)[0]


with torch.no_grad():
    g = -a_log.exp()[:, None] * torch.nn.functional.softplus(raw.float() + dt_bias.view(H, D))
print(f"g min {g.min().item():.1f}")
eager = step(call)
compiled = step(torch.compile(call, fullgraph=True))
for name, a, b in [("o", eager[0], compiled[0])] + [(f"grad{i}", x, y) for i, (x, y) in enumerate(zip(eager[1], compiled[1]))]:
    assert torch.isfinite(a).all(), name
    assert torch.equal(a, b), f"{name}: compiled differs from eager"
print("user call: eager and torch.compile finite, compiled bitwise eager")
PY
(cd /tmp && timeout 300 /tmp/user_venv/bin/python /tmp/user_call.py) > "$OUT/user_call.log" 2>&1
stamp "user call rc $?: $(tail -2 "$OUT/user_call.log" | tr '\n' ' ')"
# 3b. FLA's own layer as a user trains it after `pip install kda_aot[fla]` and `import kda_aot.fla`: the installed
# wheel serves its chunk_kda and its short convolutions (counted), and agrees with FLA's kernels (FLA_KDA_AOT=0)
cat > /tmp/user_fla_layer.py <<'PY'
import os, sys, types
from pathlib import Path
import torch
import fla
import kda_aot.fla as backend

assert "/tmp/user_venv/" in backend.__file__, backend.__file__
pkg = types.ModuleType("fla.layers")  # FLA's layers without their __init__ (it imports transformers)
pkg.__path__ = [str(Path(fla.__file__).parent / "layers")]
sys.modules["fla.layers"] = pkg
from fla.layers.kda import KimiDeltaAttention

served = {n: 0 for n in ("chunk_kda", "conv1d_silu_fwd_op", "conv1d_silu_bwd_op")}
for n in served:
    def counted(*a, inner=getattr(backend, n), n=n, **k):
        served[n] += 1
        return inner(*a, **k)
    setattr(backend, n, counted)
torch.manual_seed(0)
layer = KimiDeltaAttention(hidden_size=1024, head_dim=128, num_heads=8, mode="chunk").cuda().to(torch.bfloat16)
lens = [1, 63, 64, 65, 2000, 0, 700]
cu = torch.tensor([0] + lens, device="cuda").cumsum(0)
x = torch.randn(1, sum(lens), 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
result = {}
for arm in ("0", "1"):
    os.environ["FLA_KDA_AOT"] = arm
    layer.zero_grad(set_to_none=True)
    x.grad = None
    y = layer(x, cu_seqlens=cu)[0]
    y.sum().backward()
    result[arm] = {"y": y.detach(), "dx": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    if arm == "0":
        assert not any(served.values()), served
assert served == {"chunk_kda": 1, "conv1d_silu_fwd_op": 3, "conv1d_silu_bwd_op": 3}, served
worst = 0.0
for n, a in result["1"].items():
    b = result["0"][n]
    assert torch.isfinite(a).all(), n
    worst = max(worst, ((a.double() - b.double()).norm() / b.double().norm()).item())
assert worst < 2e-2, worst
print(f"FLA layer on the installed kda_aot: served {served}; outputs and gradients within {worst:.2e} of FLA's")
PY
(cd /tmp && timeout 300 /tmp/user_venv/bin/python /tmp/user_fla_layer.py) > "$OUT/user_fla_layer.log" 2>&1
stamp "FLA layer rc $?: $(tail -1 "$OUT/user_fla_layer.log")"
(cd /tmp && KDA_AOT_TEST_INSTALLED=1 timeout 300 /tmp/user_venv/bin/python -m pytest -q -p no:cacheprovider \
  --rootdir "$ROOT" "$ROOT/tests/test_installed.py" "$ROOT/tests/test_ops_gpu.py" "$ROOT/tests/test_readme.py") > "$OUT/pytest_installed.log" 2>&1
stamp "installed tests: $(tail -1 "$OUT/pytest_installed.log")"
