"""(program, form) -> the compiled library of that record for the arch of the GPU it launches on.

The manifest is the source of truth: in a source checkout the repo's build.json and
build.test.json, in an installed wheel the copy of build.json shipped beside the libraries.
A library whose embedded record hash differs from the manifest's is stale and never loads.
"""
from __future__ import annotations

import functools
import importlib
import json
import os
import warnings
from pathlib import Path

import torch

from .arch import DEFAULT_ARCH, arch_of
from .packing import HEAD_DIM

PACKAGE = Path(__file__).resolve().parent.parent  # kda_aot/
REPO = PACKAGE.parent
BUILD_HINT = "python setup.py build_ext --inplace"
TEST_BUILD_HINT = "KDA_AOT_TEST_RECORDS=1 python setup.py build_ext --inplace"
INSTALL_HINT = "reinstall kda_aot from a wheel built for this arch (`KDA_AOT_ARCH=<arch> pip wheel .` in a checkout)"


class RecordError(RuntimeError):
    """A record is unknown, not built, built for another arch, or stale; `record` is its (program, form)."""

    def __init__(self, message: str, record: tuple | None = None):
        super().__init__(message)
        self.record = record


def in_checkout() -> bool:
    """kda_aot runs from a source checkout (the manifests and codegen beside it), not from an installed wheel."""
    return (REPO / "codegen").is_dir() and (REPO / "build.json").is_file()


def build_hint(shipped: bool) -> str:
    """How to get a missing or stale library: build it in the checkout, or reinstall the wheel."""
    if not in_checkout():
        return INSTALL_HINT
    return f"build it with `{BUILD_HINT if shipped else TEST_BUILD_HINT}`"


def _manifest_files() -> list[Path]:
    if in_checkout():
        return [REPO / "build.json", REPO / "build.test.json"]
    return [PACKAGE / "_lib" / "build.json"]


@functools.lru_cache(maxsize=None)
def records() -> tuple[dict, ...]:
    out = []
    for path in _manifest_files():
        if path.is_file():
            doc = json.loads(path.read_text())
            out += [dict(r, shipped=doc["shipped"]) for r in doc["records"]]
    if not out:
        raise RecordError(f"no manifest found (looked for {[str(p) for p in _manifest_files()]})")
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _arch_of_index(index: int) -> str:
    return arch_of(torch.cuda.get_device_capability(index))


def running_arch(device=None) -> str:
    """Arch of the CUDA device `device` (default: the current one); without a GPU, KDA_AOT_ARCH or DEFAULT_ARCH
    (for loading only)."""
    if not torch.cuda.is_available():
        return os.environ.get("KDA_AOT_ARCH", DEFAULT_ARCH)
    if device is None:
        return _arch_of_index(torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"kda_aot kernels launch on CUDA devices, not {device}")
    return _arch_of_index(torch.cuda.current_device() if device.index is None else device.index)


def record(program: str, form: str = "default", arch: str | None = None) -> dict:
    arch = arch or running_arch()
    matches = [r for r in records() if r["program"] == program and r["form"] == form]
    if not matches:
        known = sorted({(r["program"], r["form"]) for r in records()})
        raise RecordError(f"unknown record {program}/{form}; known: {known}", (program, form))
    for r in matches:
        if r["arch"] == arch:
            return r
    raise RecordError(f"record {program}/{form} has no build for {arch} "
                      f"(rendered for {sorted(r['arch'] for r in matches)})", (program, form))


def library(program: str, form: str = "default", device=None):
    """The loaded extension module of (program, form) for the arch of `device` (the GPU the launch runs on;
    default: the current one), its hash checked against the manifest. On a node whose GPUs differ in arch the
    current device need not be the tensors'."""
    return _library(program, form, running_arch(device))


@functools.lru_cache(maxsize=None)
def _library(program: str, form: str, arch: str):
    rec = record(program, form, arch)
    hint = build_hint(rec["shipped"])
    name = f"{program}/{form} (record {rec['name']}, {rec['arch']})"
    try:
        mod = importlib.import_module(rec["module"])
    except ImportError as e:
        raise RecordError(f"{name} is not built ({e}); {hint}", (program, form)) from None
    if getattr(mod, "RECORD", None) != rec["name"] or getattr(mod, "ARCH", None) != rec["arch"]:
        raise RecordError(f"{name}: the built library is stale (it holds record {getattr(mod, 'RECORD', '?')} "
                          f"for {getattr(mod, 'ARCH', '?')}); {hint}", (program, form))
    return mod


library.cache_clear = _library.cache_clear  # tests swap builds and manifests under the registry


def built_forms(program: str, forms=None) -> list[str]:
    """The forms of `program` (all its records', or those of `forms`, in that order) whose libraries
    are built here and current: benchmarks and A/B scripts time what is there."""
    if forms is None:
        forms = [r["form"] for r in records() if r["program"] == program]
    out = []
    for form in forms:
        try:
            library(program, form)
            out.append(form)
        except RecordError:
            pass
    return out


def constant_under_compile(fn):
    """torch.compiler.assume_constant_result's mark (torch.compile reads fn's result while tracing), set
    without importing torch._dynamo, which that decorator does and which is most of `import kda_aot`'s own time
    (docs/packaging.md).
    tests/test_registry.py checks that the decorator sets this attribute and nothing else."""
    fn._dynamo_marked_constant = True
    return fn


@constant_under_compile  # a fact of the machine
def serves(device) -> bool:
    """Whether the kernels run on `device`: a CUDA device whose arch has shipped records (the "auto"
    backends' choice)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    arch = running_arch(device)
    return any(r["arch"] == arch and r["shipped"] for r in records())


def auto_backend(x, head_dim: int = HEAD_DIM) -> str:
    """What backend="auto" picks for inputs like x: "cuda" (the kernels) for a bf16 tensor on a GPU they
    serve, with heads of the kernels' HEAD_DIM (the caller's head dim, where its inputs have heads), else
    "reference". A CUDA tensor sent to the reference gets a warning that says why (the reference is torch math:
    correct, and orders of magnitude slower than the kernels)."""
    if not isinstance(x, torch.Tensor):
        return "reference"
    if head_dim == HEAD_DIM and x.dtype == torch.bfloat16 and serves(x.device):
        return "cuda"
    if x.is_cuda and not torch.compiler.is_compiling():  # (the reason reads the manifest: not traceable)
        warnings.warn(f"backend='auto' runs kda_aot.reference (torch math, far slower than the kernels) on "
                      f"{x.device}: {_reference_reason(x, head_dim)}; pass backend='reference' to choose it",
                      stacklevel=3)
    return "reference"


def _reference_reason(x: torch.Tensor, head_dim: int) -> str:
    """Why auto_backend sends a CUDA tensor x to the reference."""
    if head_dim != HEAD_DIM:
        return f"head_dim {head_dim} (the kernels' is {HEAD_DIM})"
    if not serves(x.device):
        shipped = ", ".join(sorted({r["arch"] for r in records() if r["shipped"]})) or "none"
        return f"no kernels for {torch.cuda.get_device_name(x.device)} ({running_arch(x.device)}; this install's: {shipped})"
    return f"{str(x.dtype).replace('torch.', '')} inputs (the kernels take bfloat16: cast them or run under torch.autocast)"
