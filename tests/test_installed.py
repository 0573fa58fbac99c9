"""The installed wheel against the source tree (KDA_AOT_TEST_INSTALLED=1: CI installs the wheel into a
fresh venv and runs the suite from outside the checkout).

The installed package must be the source tree's package byte for byte, plus what the build adds:
the shipped manifest (_lib/build.json, the checkout's build.json), build_info.py (the version and
arch) and one extension module per shipped record, each of which loads and names its record.
"""
import importlib.metadata
import importlib.util
import json
from pathlib import Path

import pytest

from conftest import INSTALLED, INSTALLED_ONLY, ROOT

pytestmark = pytest.mark.skipif(not INSTALLED, reason=INSTALLED_ONLY)

# What a build writes into the package folder (in place too, so a checkout may hold them): never compared.
BUILT = ("_lib/build.json", "_lib/build_info.py")


def installed_package() -> Path:
    import kda_aot
    return Path(kda_aot.__file__).resolve().parent


def files_of(package: Path) -> set:
    """The package's files as paths relative to it, without bytecode caches and extension modules."""
    return {f.relative_to(package).as_posix() for f in package.rglob("*")
            if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".so"}


def shipped_records() -> list:
    return json.loads((installed_package() / "_lib" / "build.json").read_text())["records"]


def test_kda_aot_is_the_installed_distribution_and_codegen_the_checkouts():
    import kda_aot
    from kda_aot import _lib
    dist = importlib.metadata.distribution("kda_aot")
    package = installed_package()
    assert package == Path(dist.locate_file("kda_aot")).resolve() and ROOT not in package.parents
    assert kda_aot.__version__ == _lib.VERSION == dist.version
    assert {r["arch"] for r in shipped_records()} == {_lib.ARCH}
    assert kda_aot.__version__.endswith("+" + _lib.ARCH.replace("_", ""))
    # the wheel holds the package alone: codegen is the checkout's, bench and tests are not installed
    assert {Path(str(f)).parts[0] for f in dist.files} == {"kda_aot", f"kda_aot-{dist.version}.dist-info"}
    assert ROOT in Path(importlib.util.find_spec("codegen").origin).resolve().parents


def test_modules_and_data_are_the_source_trees():
    package, source = installed_package(), ROOT / "kda_aot"
    expected = {f for f in files_of(source) if f not in BUILT}
    got = files_of(package)
    assert got - set(BUILT) == expected, (f"missing from the wheel: {sorted(expected - got)}; "
                                           f"not in the source tree: {sorted(got - expected - set(BUILT))}")
    differ = [f for f in sorted(expected) if (package / f).read_bytes() != (source / f).read_bytes()]
    assert not differ, f"the installed files differ from the source tree's: {differ}"
    assert (package / "_lib" / "build.json").read_bytes() == (ROOT / "build.json").read_bytes()


def test_every_shipped_record_has_its_module_and_loads():
    from kda_aot._runtime import registry
    package = installed_package()
    assert registry.in_checkout() is False
    assert [r["name"] for r in registry.records()] == [r["name"] for r in shipped_records()]
    modules = {p.name.split(".")[0] for p in (package / "_lib").glob("*.so")}
    assert modules == {r["module"].rsplit(".", 1)[1] for r in shipped_records()}
    registry.library.cache_clear()
    for rec in shipped_records():
        origin = Path(importlib.util.find_spec(rec["module"]).origin).resolve()
        assert origin.parent == package / "_lib", origin
        lib = registry.library(rec["program"], rec["form"])
        assert (lib.RECORD, lib.ARCH, lib.PROGRAM, lib.FORM) == (rec["name"], rec["arch"], rec["program"],
                                                                 rec["form"])


def test_fit_rule_reads_the_installed_parameters():
    from kda_aot.schedule import fit
    assert fit.params_file("NVIDIA H200").resolve() == installed_package() / "schedule" / "fit_params" / "nvidia_h200.json"
    measured = json.loads((ROOT / "kda_aot" / "schedule" / "fit_params" / "nvidia_h200.json").read_text())["programs"]
    assert set(fit.measured_rho()) == set(measured) and measured
