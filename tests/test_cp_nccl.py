"""Context parallelism over NCCL on 2 GPUs, reference backend on CUDA tensors.

The same cases and checks as test_cp_gloo.py at W = 2 (every layout and pack, both backward
modes, the module, the conv halo, disagreeing ranks), with the ranks' tensors on GPUs 0 and 1:
it checks the device handling of the exchanges (NCCL moves only CUDA tensors) and the CP
bookkeeping on CUDA, ahead of the CUDA backend. The single-device results are computed on the
CPU; the bounds are test_cp_gloo's (GPU and CPU fp32 differ by rounding only). Skipped
without 2 GPUs.
"""
from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import cp_workers  # noqa: E402
from conftest import gpu  # noqa: E402
import test_cp_gloo as G  # noqa: E402

pytestmark = [gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]
W = 2
_JOB = {}


def results(name):
    if not _JOB:
        with tempfile.TemporaryDirectory(prefix="kda_cp_nccl_") as d:
            per_rank = cp_workers.run_job(W, G.cases_for(W), d, G.JOB_TIMEOUT_S, device="cuda")
        _JOB.update({n: [r.get(n, {"error": "missing"}) for r in per_rank] for n in per_rank[0]})
    return G.check_results(_JOB.get(name), f"nccl {name}")


CASES = [(lay, p) for lay in G.LAYOUTS for p in G.SWEEP[W]]


@pytest.mark.parametrize("layout,pack", CASES)
def test_op(layout, pack):
    G.check_op(results(f"op/{layout}/{pack}"), W, layout, pack)


@pytest.mark.parametrize("layout,pack", [(lay, p) for lay in G.LAYOUTS for p in G.FP64_PACKS[W]])
def test_op_fp64(layout, pack):
    G.check_op64(results(f"op64/{layout}/{pack}"), W, layout, pack)


@pytest.mark.parametrize("layout,pack", CASES)
def test_module(layout, pack):
    G.check_module(results(f"module/{layout}/{pack}"), W, layout, pack)


@pytest.mark.parametrize("layout,pack", CASES)
def test_conv(layout, pack):
    G.check_conv(results(f"conv/{layout}/{pack}"), W, layout, pack)


@pytest.mark.parametrize("variant", G.ERROR_VARIANTS)
def test_errors(variant):
    G.check_error(results(f"error/{variant}"), W, variant)
