"""Build kda_aot: one wheel for one GPU arch from the shipped manifest (build.json).

    KDA_AOT_ARCH=sm_90a          arch to build for (default: the local GPU's, else sm_90a)
    KDA_AOT_TEST_RECORDS=1       also build the test-only records (build.test.json); ignored by bdist_wheel
    KDA_AOT_PROGRAMS=a,b         build only these programs (a subset, for quick device runs)
    KDA_AOT_JOBS=N               parallel compiler processes (default: CPU count)

Kernel units are compiled by nvcc, binding units by the host C++ compiler (they hold no device
code), one Python extension module per record, beside kda_aot/_lib/build_info.py (the version and
arch they were built for: kda_aot.__version__). Objects are cached under build/obj by record hash.
Refuses to build from a stale generated/ (run `python -m codegen render`). The project's metadata
and dependencies are in pyproject.toml; the version is computed here from the arch.
"""
from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))  # codegen is this repo's build-time package

VERSION = "0.1.0"


def _arch_table():
    """kda_aot/_runtime/arch.py, the one capability -> arch table, loaded without importing kda_aot (torch)."""
    spec = importlib.util.spec_from_file_location("_kda_aot_arch", ROOT / "kda_aot" / "_runtime" / "arch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def target_arch() -> str:
    arch = os.environ.get("KDA_AOT_ARCH")
    if arch:
        return arch
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.split()
        if out:
            return _arch_table().arch_of(out[0].split("."))
    except (OSError, subprocess.SubprocessError):
        pass
    return _arch_table().DEFAULT_ARCH


def cuda_home() -> Path:
    env = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if env:
        return Path(env)
    if Path("/usr/local/cuda/bin/nvcc").exists():
        return Path("/usr/local/cuda")
    nvcc = shutil.which("nvcc")
    if not nvcc:
        raise SystemExit("kda_aot: nvcc not found; set CUDA_HOME")
    return Path(nvcc).resolve().parent.parent


def selected_records(arch: str) -> list[dict]:
    # Test-only records are for in-place test builds; a wheel never carries them.
    with_tests = os.environ.get("KDA_AOT_TEST_RECORDS") == "1" and "bdist_wheel" not in sys.argv
    manifests = ["build.json"] + (["build.test.json"] if with_tests else [])
    records = []
    for name in manifests:
        records += json.loads((ROOT / name).read_text())["records"]
    records = [r for r in records if r["arch"] == arch]
    if not records:
        raise SystemExit(f"kda_aot: no records for arch {arch} in {manifests}")
    wanted = os.environ.get("KDA_AOT_PROGRAMS")
    if wanted:
        names = {p.strip() for p in wanted.split(",") if p.strip()}
        unknown = names - {r["program"] for r in records}
        if unknown:
            raise SystemExit(f"kda_aot: KDA_AOT_PROGRAMS names unknown programs {sorted(unknown)}")
        records = [r for r in records if r["program"] in names]
    return records


def refuse_stale() -> None:
    from codegen.__main__ import differences
    from codegen.render import actual_tree, expected_tree
    diffs = differences(expected_tree(), actual_tree())
    if diffs:
        listing = "\n".join(f"  {kind}: {path}" for kind, path in diffs)
        raise SystemExit(f"kda_aot: generated/ is stale:\n{listing}\nrun `python -m codegen render` first")


ARCH = target_arch()
# The local version label says which GPU arch the wheel's kernels are for.
PACKAGE_VERSION = f"{VERSION}+{ARCH.replace('_', '')}"


class BuildRecords(build_ext):
    """Compile each record's two units and link them into the record's extension module."""

    def build_extensions(self):
        refuse_stale()
        cuda = cuda_home()
        obj_dir = ROOT / "build" / "obj"
        obj_dir.mkdir(parents=True, exist_ok=True)
        jobs = int(os.environ.get("KDA_AOT_JOBS") or os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            # Compile all units first (the slow part, in parallel), then link each module.
            futures = {ext.name: (pool.submit(self._kernel_obj, ext, cuda, obj_dir),
                                  pool.submit(self._binding_obj, ext, obj_dir)) for ext in self.extensions}
            links = [pool.submit(self._link, ext, cuda, futures[ext.name][0].result(),
                                 futures[ext.name][1].result()) for ext in self.extensions]
            for f in links:
                f.result()

    def run(self):
        super().run()  # in place, setuptools links into build_lib and then copies the modules over
        # Beside the extension modules: what kda_aot.__version__ reports.
        lib_dir = ROOT / "kda_aot" / "_lib" if self.inplace else Path(self.build_lib) / "kda_aot" / "_lib"
        (lib_dir / "build_info.py").write_text(
            "# Written by setup.py's build_ext: what the extension modules here were built for.\n"
            f"VERSION = {PACKAGE_VERSION!r}\nARCH = {ARCH!r}\n")

    @staticmethod
    def _run(cmd: list[str]) -> None:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"kda_aot build failed:\n{' '.join(cmd)}\n{proc.stdout}{proc.stderr}")

    def _kernel_obj(self, ext, cuda: Path, obj_dir: Path) -> Path:
        rec = ext.record
        out = obj_dir / f"{rec['name']}_kernel.o"
        if not out.exists():
            tmp = out.with_suffix(f".tmp{os.getpid()}.o")
            self._run([str(cuda / "bin" / "nvcc"), *rec["flags"], "-I", str(ROOT / "templates"),
                       "-c", str(ROOT / "generated" / f"{rec['name']}_kernel.cu"), "-o", str(tmp)])
            tmp.replace(out)
        return out

    def _binding_obj(self, ext, obj_dir: Path) -> Path:
        import pybind11
        rec = ext.record
        tag = sysconfig.get_config_var("SOABI") or "py"
        out = obj_dir / f"{rec['name']}_binding.{tag}.o"
        if not out.exists():
            tmp = out.with_suffix(f".tmp{os.getpid()}.o")
            cxx = os.environ.get("CXX", "c++")
            self._run([cxx, "-O2", "-std=c++17", "-fPIC", "-fvisibility=hidden",
                       "-I", str(ROOT / "templates"), "-I", pybind11.get_include(),
                       "-I", sysconfig.get_paths()["include"],
                       "-c", str(ROOT / "generated" / f"{rec['name']}_binding.cpp"), "-o", str(tmp)])
            tmp.replace(out)
        return out

    def _link(self, ext, cuda: Path, kernel_obj: Path, binding_obj: Path) -> None:
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        cxx = os.environ.get("CXX", "c++")
        # Static cudart: the module needs only the driver, whichever CUDA runtime torch carries.
        self._run([cxx, "-shared", "-o", str(target), str(binding_obj), str(kernel_obj),
                   "-L", str(cuda / "lib64"), "-lcudart_static", "-ldl", "-lrt", "-lpthread"])


class BuildPy(build_py):
    """Ship the shipped manifest with the package so the registry can check hashes in a wheel."""

    def run(self):
        # build_py runs first in `build`: an empty package folder keeps modules deleted from the tree
        # (and a checkout's earlier builds) out of the wheel.
        shutil.rmtree(Path(self.build_lib) / "kda_aot", ignore_errors=True)
        super().run()
        dest = Path(self.build_lib) / "kda_aot" / "_lib"
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / "build.json", dest / "build.json")


class RecordExtension(Extension):
    def __init__(self, record: dict):
        super().__init__(record["module"], sources=[])
        self.record = record


setup(
    version=PACKAGE_VERSION,
    # The package and its data only: codegen and templates are build inputs, bench and tests stay in the checkout.
    packages=find_packages(exclude=["codegen", "codegen.*", "bench", "bench.*", "tests", "tests.*"]),
    package_data={"kda_aot.schedule": ["fit_params/*.json"]},
    include_package_data=False,  # what ships is package_data above, whatever else the tree holds
    ext_modules=[RecordExtension(r) for r in selected_records(ARCH)],
    cmdclass={"build_ext": BuildRecords, "build_py": BuildPy},
    zip_safe=False,
)
