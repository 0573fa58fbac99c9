import contextlib
import importlib.metadata
import json
import os
import sys
import zlib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
# KDA_AOT_TEST_INSTALLED=1: the tests import the installed kda_aot (CI's run against the wheel, from
# outside the checkout); codegen and bench always come from the checkout.
INSTALLED = os.environ.get("KDA_AOT_TEST_INSTALLED") == "1"
INSTALLED_ONLY = "checks the installed wheel: runs with KDA_AOT_TEST_INSTALLED=1 (CI's installed run)"
CHECKOUT_ONLY = "tests the checkout's build, not the installed wheel (KDA_AOT_TEST_INSTALLED=1)"


def _import_installed_kda_aot():
    """Import kda_aot with every path entry of the checkout out of the way (pytest run from its root puts
    the cwd first), and refuse to go on unless it is the installed distribution's."""
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
    import kda_aot
    where = Path(kda_aot.__file__).resolve()
    try:
        dist = importlib.metadata.distribution("kda_aot")
    except importlib.metadata.PackageNotFoundError:
        raise pytest.UsageError("KDA_AOT_TEST_INSTALLED=1 but kda_aot is not installed") from None
    installed = Path(dist.locate_file("kda_aot/__init__.py")).resolve()
    if where != installed or ROOT in where.parents:
        raise pytest.UsageError(f"KDA_AOT_TEST_INSTALLED=1 but kda_aot came from {where}, not from the "
                                f"installed {installed}: run pytest from outside the checkout")


if INSTALLED:
    _import_installed_kda_aot()
    sys.path.append(str(ROOT))  # codegen and bench, behind the installed kda_aot
else:
    sys.path.insert(0, str(ROOT))  # the codegen package and kda_aot from the checkout

from kda_aot._runtime import registry  # noqa: E402  (after the path is settled)

# The test-only records (build.test.json): not in a wheel, so tests of them skip in the installed run.
TEST_ONLY_RECORDS = frozenset((r["program"], r["form"])
                              for r in json.loads((ROOT / "build.test.json").read_text())["records"])

HAS_GPU = torch.cuda.is_available()
# KDA_AOT_REQUIRE_FLA=1 (CI, the device scripts): a test that needs flash-linear-attention fails without it
# instead of skipping, so a run that lost FLA cannot pass with its comparisons left out.
REQUIRE_FLA = os.environ.get("KDA_AOT_REQUIRE_FLA") == "1"


def import_fla(module: str):
    """FLA's `module` (or einops, which its layer needs), else a skip (a failure under KDA_AOT_REQUIRE_FLA=1)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing = f"{module} is not installed ({e})"
        if REQUIRE_FLA:
            pytest.fail(missing + "; KDA_AOT_REQUIRE_FLA=1 asks for it")
        pytest.skip(missing)


# A test that needs a CUDA GPU: skipped without one (pytest_runtest_setup); with one, every allocation it makes
# starts as NaN (nan_filled_memory).
gpu = pytest.mark.gpu


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None and not HAS_GPU:
        pytest.skip("needs a CUDA GPU (none here)")


@pytest.fixture(autouse=True)
def nan_filled_memory(request):
    """GPU tests run in torch's deterministic mode, which fills every uninitialised allocation with NaN: an output
    the ops allocate and a kernel leaves partly unwritten cannot pass as stale finite values. (warn_only: torch ops
    without a deterministic form, in FLA's code, still run. The mode is bitwise the default for our ops:
    tests/test_ops_gpu.py runs the default mode beside it.)"""
    if request.node.get_closest_marker("gpu") is None or not HAS_GPU:
        yield
        return
    with deterministic_mode(True, warn_only=True):
        yield


@contextlib.contextmanager
def deterministic_mode(on: bool, warn_only: bool = False):
    """torch.use_deterministic_algorithms(on) with uninitialised allocations NaN-filled when on; the mode before
    restored after."""
    import torch.utils.deterministic
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(on, warn_only=warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = on
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = before[2]

# Fresh inputs each run; the seed is printed so a failure can be replayed (KDA_TEST_SEED=...).
SEED = int(os.environ.get("KDA_TEST_SEED", int.from_bytes(os.urandom(4), "little")))


def pytest_report_header(config):
    import kda_aot
    return (f"KDA_TEST_SEED={SEED} gpu={torch.cuda.get_device_name() if HAS_GPU else 'none'} "
            f"kda_aot {kda_aot.__version__} from {Path(kda_aot.__file__).parent}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """In the installed run a test that asks for a test-only record skips, naming it: the wheel ships none."""
    try:
        return (yield)
    except registry.RecordError as e:
        if INSTALLED and e.record in TEST_ONLY_RECORDS:
            pytest.skip(f"needs the test-only record {'/'.join(e.record)}, which no wheel ships")
        raise


def seed_of(tag) -> int:
    """A seed fresh per run (from SEED) and the same for a tag within it: replay with KDA_TEST_SEED=<SEED>. (crc32
    of the tag's repr, not hash(): str hashes vary with PYTHONHASHSEED.)"""
    return (SEED * 1000003 + zlib.crc32(repr(tag).encode())) % (2 ** 63)


def generator(tag, device="cpu") -> torch.Generator:
    """A generator on `device` seeded with seed_of(tag): every test's random inputs come from one of these."""
    return torch.Generator(device=device).manual_seed(seed_of(tag))


@pytest.fixture(autouse=True)
def seeded_global_rng(request):
    """torch's global generators (module weights, randn_like) seeded per test from SEED and its id: fresh each
    run, the same for a test when replayed, whatever ran before it."""
    torch.manual_seed(seed_of(request.node.nodeid))


@pytest.fixture
def gen(request):
    """A CPU generator seeded from SEED and the test's id: fresh per run, replayable per test."""
    print(f"[seed] KDA_TEST_SEED={SEED} -> {request.node.nodeid}")
    return generator(request.node.nodeid)


@pytest.fixture
def kda_options():
    """set(**changes): kda_aot's Options changed so for the rest of the test (kda_aot.options.using)."""
    from kda_aot import options
    before = options.current()

    def set_options(**changes):
        options.swap(options.current().replace(**changes))

    yield set_options
    options.swap(before)


@pytest.fixture
def reference_op(monkeypatch):
    """kda_aot.chunk_kda's KDA op as the fp64 reference (autograd through it), so that everything the call does
    around the op runs on the CPU; records the modes it was called in."""
    from kda_aot import reference
    from kda_aot.ops import chunk_kda as op
    from kda_aot.reference import beta_sigmoid, l2norm
    from kda_aot.schedule import kda
    calls = []

    def fake(saved):
        def run(q, k, v, g, beta, h0, cu, scale, output_final_state, beta_kind=kda.BETA_PLAIN, keep=False):
            assert not (saved and keep)  # the replay's forward alone keeps what the replay reads
            calls.append("saved" if saved else "replay")
            if beta_kind != kda.BETA_PLAIN:  # the kernels' activation of the logits, as FLA's: fp32 sigmoid, unrounded
                beta = beta_sigmoid(beta, beta_kind == kda.BETA_SIGMOID_2, torch.float32)
            o, s = reference.kda_chunked(*(x.double() for x in (q, k, v, g, beta)), cu_seqlens=cu.tolist(),
                                         scale=scale, initial_state=None if h0 is None else h0.double(),
                                         output_final_state=True, dtype=torch.float64)
            return o, s
        return run
    monkeypatch.setattr(op, "chunk_kda_fwd_op", fake(False))
    monkeypatch.setattr(op, "chunk_kda_fwd_saved_op", fake(True))
    monkeypatch.setattr(op, "_qk_l2norm", lambda q, k: (l2norm(q), l2norm(k)))  # the kernel's formula
    return calls
