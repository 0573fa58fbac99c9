#!/usr/bin/env bash
# One device call (nvidia-h200): the wheel as a user gets it.
#   1. `pip wheel` of the checkout (shipped records, 16 jobs)
#   2. a fresh venv outside the checkout with only the wheel installed; it sees the device's torch (and the
#      carried FLA wheels in /tmp/site) through a .pth, the machine having no network
#   3. from /tmp: FLA's layer call as training code makes it (q, k, v views of one fused projection, the raw bf16
#      gate x 8 with A_log and dt_bias so that g reaches -30, beta logits, q and k L2-normalised in the call, documents of
#      1, 63, 64, 65 and 2,000 tokens), eager and under torch.compile, `o.sum().backward()`: finite, and the
#      compiled gradients bitwise the eager ones
#   4. tests/test_installed.py and tests/test_ops_gpu.py against the installed package (KDA_AOT_TEST_INSTALLED=1)
# Logs in $OUT (wheel.log, user_call.log, pytest_installed.log).
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
(cd /tmp && KDA_AOT_TEST_INSTALLED=1 timeout 300 /tmp/user_venv/bin/python -m pytest -q -p no:cacheprovider \
  --rootdir "$ROOT" "$ROOT/tests/test_installed.py" "$ROOT/tests/test_ops_gpu.py") > "$OUT/pytest_installed.log" 2>&1
stamp "installed tests: $(tail -1 "$OUT/pytest_installed.log")"
