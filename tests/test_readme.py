"""The README's "Using it" examples run as written: the CPU one here (the reference), the GPU one on a GPU
(and from the installed wheel in bench/device_wheel.sh)."""
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def examples() -> list:
    """The python blocks of the README's "Using it" section, in order."""
    text = README.read_text()
    section = text[text.index("## Using it\n"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_cpu_example_runs_on_the_reference():
    cpu = examples()[1]
    # the form chunk_kda's CPU refusal names, call by call (beta in fp64: the kernels never round it to bf16)
    from kda_aot._runtime.tensor import CPU_COUNTERPARTS
    for form in ("kda_aot.reference.kda_chunked", "kda_aot.reference.l2norm", "kda_gate(g, A_log, dt_bias, lower_bound)",
                 "beta_sigmoid(beta, allow_neg_eigval, dtype=torch.float64)"):
        assert form in CPU_COUNTERPARTS["chunk_kda"], form
    for call in ("reference.kda_chunked(", "reference.l2norm(q)", "reference.kda_gate(raw, A_log, dt_bias, None)",
                 "reference.beta_sigmoid(b, False, dtype=torch.float64)"):
        assert call in cpu, call
    scope = {}
    exec(compile(cpu, "README.md (CPU example)", "exec"), scope)
    o, final = scope["o"], scope["final"]
    assert o.shape == (1, 200, 2, 128) and final.shape == (2, 2, 128, 128) and torch.isfinite(o).all()


@pytest.mark.gpu
def test_the_gpu_example_runs():
    gpu = examples()[0]
    assert "kda_aot.chunk_kda" in gpu
    scope = {}
    exec(compile(gpu, "README.md (GPU example)", "exec"), scope)
    assert torch.isfinite(scope["o"]).all() and torch.isfinite(scope["proj"].grad).all()
    assert torch.isfinite(scope["y"]).all() and torch.isfinite(scope["A_log"].grad).all()
