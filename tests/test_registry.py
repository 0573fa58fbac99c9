"""Runtime registry: loading by (program, form), hash checks, clear errors, ABI agreement, wheel contents."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import CHECKOUT_ONLY, INSTALLED, ROOT
from kda_aot._runtime import registry
from kda_aot._runtime.tensor import DTYPE_CODES


@pytest.fixture(autouse=True)
def fresh_cache():
    registry.library.cache_clear()
    yield
    registry.library.cache_clear()


def built_records():
    return [r for r in registry.records() if r["shipped"]]


@pytest.mark.parametrize("rec", built_records(), ids=lambda r: f"{r['program']}/{r['form']}")
def test_shipped_record_loads_with_matching_hash(rec):
    lib = registry.library(rec["program"], rec["form"])
    assert lib.RECORD == rec["name"] and lib.ARCH == rec["arch"]
    assert lib.PROGRAM == rec["program"] and lib.FORM == rec["form"]


def test_binding_dtype_codes_match_python():
    for rec in built_records():
        lib = registry.library(rec["program"], rec["form"])
        assert lib.DTYPE_CODES == {str(dt).removeprefix("torch."): code for dt, code in DTYPE_CODES.items()}


def test_unknown_record_names_it():
    with pytest.raises(registry.RecordError, match="unknown record conv1d_silu_fwd/nope"):
        registry.library("conv1d_silu_fwd", "nope")


def test_other_arch_is_refused():
    with pytest.raises(registry.RecordError, match="no build for sm_80"):
        registry.record("conv1d_silu_fwd", "default", arch="sm_80")


def test_the_arch_is_the_launch_device_s(monkeypatch):
    """On a node whose GPUs differ in arch, library() loads the record of the device it is given, not the
    current device's: a launch on the sm_90a GPU loads while an sm_80 GPU is current; one on the sm_80 GPU, or on
    the current device, is refused by name."""
    caps = {0: (9, 0), 1: (8, 0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: caps[index])
    registry._arch_of_index.cache_clear()
    try:
        assert registry.library("conv1d_silu_fwd", "default", torch.device("cuda", 0)).ARCH == "sm_90a"
        for device in (None, "cuda:1", torch.device("cuda")):
            with pytest.raises(registry.RecordError, match="conv1d_silu_fwd/default has no build for sm_80"):
                registry.library("conv1d_silu_fwd", "default", device)
        with pytest.raises(ValueError, match="launch on CUDA devices, not cpu"):
            registry.library("conv1d_silu_fwd", "default", "cpu")
        assert registry.serves("cuda:0") and not registry.serves("cuda:1") and not registry.serves("cpu")
    finally:
        registry._arch_of_index.cache_clear()


def _patched_records(monkeypatch, **change):
    recs = tuple(dict(r, **change) if (r["program"], r["form"]) == ("conv1d_silu_fwd", "default") else r
                 for r in registry.records())
    monkeypatch.setattr(registry, "records", lambda: recs)


def test_stale_library_is_refused_with_build_command(monkeypatch):
    _patched_records(monkeypatch, name="0123456789abcdef")
    with pytest.raises(registry.RecordError) as e:
        registry.library("conv1d_silu_fwd", "default")
    msg = str(e.value)
    assert "conv1d_silu_fwd/default" in msg and "stale" in msg and registry.build_hint(True) in msg


def test_missing_library_names_record_and_command(monkeypatch):
    _patched_records(monkeypatch, module="kda_aot._lib._not_built__default")
    with pytest.raises(registry.RecordError, match=r"conv1d_silu_fwd/default .* is not built") as e:
        registry.library("conv1d_silu_fwd", "default")
    assert registry.build_hint(True) in str(e.value) and e.value.record == ("conv1d_silu_fwd", "default")


def test_hints_say_build_in_a_checkout_and_reinstall_when_installed(monkeypatch):
    monkeypatch.setattr(registry, "in_checkout", lambda: True)
    assert registry.BUILD_HINT in registry.build_hint(True) and registry.TEST_BUILD_HINT in registry.build_hint(False)
    monkeypatch.setattr(registry, "in_checkout", lambda: False)
    assert registry.build_hint(True) == registry.build_hint(False) == registry.INSTALL_HINT


@pytest.mark.skipif(INSTALLED, reason="the installed wheel carries no test-only records")
def test_test_only_records_point_to_the_test_build(monkeypatch):
    """A test-only record that is not built names the test build; a shipped one the plain build. The import
    fails here on purpose (the test command builds every record)."""
    def not_built(name):
        raise ImportError(f"No module named {name!r}")
    monkeypatch.setattr(registry.importlib, "import_module", not_built)
    records = registry.records()
    assert any(not r["shipped"] for r in records), "the catalog has test-only records"
    for r in records:
        registry.library.cache_clear()
        with pytest.raises(registry.RecordError, match="is not built") as e:
            registry.library(r["program"], r["form"])
        assert ("KDA_AOT_TEST_RECORDS=1" in str(e.value)) == (not r["shipped"]), (r["program"], r["form"])
    registry.library.cache_clear()


@pytest.mark.skipif(INSTALLED, reason=CHECKOUT_ONLY + "; test_installed.py checks the installed one")
def test_wheel_ships_only_shipped_records_and_names_its_arch(tmp_path):
    env = {**os.environ, "KDA_AOT_ARCH": "sm_90a", "KDA_AOT_TEST_RECORDS": "1"}
    env.pop("KDA_AOT_PROGRAMS", None)
    # KDA_AOT_TEST_RECORDS must not leak test records into a wheel: bdist_wheel ignores it.
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build", "--build-base", str(tmp_path / "build"),
                           "bdist_wheel", "-d", str(tmp_path), "--bdist-dir", str(tmp_path / "bdist")],
                          cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels = list(tmp_path.glob("kda_aot-*.whl"))
    assert len(wheels) == 1 and "+sm90a" in wheels[0].name
    names = zipfile.ZipFile(wheels[0]).namelist()
    modules = sorted(n.split("/")[-1].split(".")[0] for n in names if n.endswith(".so"))
    shipped = sorted("_" + r["program"] + "__" + r["form"] for r in built_records())
    assert modules == shipped
    assert "kda_aot/_lib/build.json" in names
    # every module and data file of the package, nothing of the checkout's build inputs, benchmarks or tests
    sources = {str(f.relative_to(ROOT)) for f in (ROOT / "kda_aot").rglob("*")
               if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".so" and f.name != "build_info.py"}
    assert {"kda_aot/schedule/fit_params/nvidia_h200.json", "kda_aot/cp/exchange.py"} <= sources
    package = {n for n in names if n.startswith("kda_aot/") and not n.endswith(".so")}
    assert package == sources | {"kda_aot/_lib/build.json", "kda_aot/_lib/build_info.py"}
    assert not [n for n in names if n.split("/")[0] in ("bench", "codegen", "tests", "templates", "generated")]
    wheel = zipfile.ZipFile(wheels[0])
    info = wheel.read("kda_aot/_lib/build_info.py").decode()
    assert "VERSION = '0.1.0+sm90a'" in info and "ARCH = 'sm_90a'" in info
    metadata = wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert "torch>=2.4" in requires and not [r for r in requires if r.startswith("numpy")]


def test_version_says_the_built_arch():
    """kda_aot.__version__ is <version>+<arch of the built kernels> (build_info.py, written by build_ext)."""
    import kda_aot
    from kda_aot import _lib
    arch = registry.library("conv1d_silu_fwd", "default").ARCH
    assert _lib.ARCH == arch and kda_aot.__version__.endswith("+" + arch.replace("_", ""))


def test_serves_is_marked_constant_as_torch_compile_reads_it():
    # registry.constant_under_compile sets assume_constant_result's mark without importing torch._dynamo;
    # a torch whose decorator marks differently fails here, not silently under torch.compile on a GPU
    import torch

    def plain():
        return True
    marked = torch.compiler.assume_constant_result(plain)
    assert marked is plain and vars(plain) == vars(registry.constant_under_compile(lambda: True))
    assert getattr(registry.serves, "_dynamo_marked_constant", False) is True


def test_import_does_not_load_torch_dynamo(tmp_path):
    # the checkout's kda_aot from its root, the installed one from anywhere else
    code = "import sys, kda_aot; print(kda_aot.__file__); print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path if INSTALLED else ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    where, loaded = out.stdout.split()
    assert (ROOT in Path(where).parents) != INSTALLED, where
    assert loaded == "False"
