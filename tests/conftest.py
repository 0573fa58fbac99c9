import os
import sys
import zlib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the codegen package and kda_aot from the checkout

HAS_GPU = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU (none here)")

# Fresh inputs each run; the seed is printed so a failure can be replayed (KDA_TEST_SEED=...).
SEED = int(os.environ.get("KDA_TEST_SEED", int.from_bytes(os.urandom(4), "little")))


def pytest_report_header(config):
    return f"KDA_TEST_SEED={SEED} gpu={torch.cuda.get_device_name() if HAS_GPU else 'none'}"


@pytest.fixture
def gen(request):
    """A CPU generator seeded from SEED and the test's id: fresh per run, replayable per test."""
    seed = (SEED + zlib.crc32(request.node.nodeid.encode())) % (2 ** 63)
    print(f"[seed] KDA_TEST_SEED={SEED} -> {request.node.nodeid} seed {seed}")
    return torch.Generator().manual_seed(seed)
