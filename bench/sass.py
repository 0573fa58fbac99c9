"""The machine code of kernel records, read here without a GPU: each record's unit compiled with its own flags
(`nvcc -cubin`), then disassembled by nvdisasm (CUDA's own, or PyPI's `nvidia-cuda-nvdisasm`, which needs no
toolkit). Prints each kernel's instruction count and the counts of the opcodes that bound our kernels (MUFU,
HMMA, ...); with --against REV, compares every selected record with the record of the same program and form at
git revision REV and says, per kernel, whether its machine code is identical. A template change meant to leave
machine code alone (comments, a Jinja `{% if %}` turned into `if constexpr`, a rename) is checked so, and then
owes no device call or sanitizer run (docs/method.md).

  python3 bench/sass.py kda_bwd_gate conv1d_silu_fwd/l2norm       # counts of the current records
  python3 bench/sass.py --against HEAD~1 conv1d_silu_fwd          # identical to HEAD~1's?
  python3 bench/sass.py --against c9c6dd0 --all --test-records     # every record, shipped and test-only
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ("build.json",)
TEST_MANIFEST = "build.test.json"
COUNTED = ("MUFU", "HMMA", "HGMMA", "LDSM", "LDS", "STS", "LDG", "STG", "BAR", "SHFL")
# A kernel's symbol carries its unit's file name in the anonymous namespace's mangling; two renderings of one
# kernel are matched without it.
_ANON = re.compile(r"_GLOBAL__N__[0-9a-f]{8}_\d+_[0-9a-f]+_kernel_cu_[0-9a-f]{8}")
_INSTR = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_FUNC = re.compile(r"^\.text\.(\S+):$")


def find_nvdisasm() -> str:
    """nvdisasm from PATH, CUDA_HOME, /usr/local/cuda*, or the nvidia-cuda-nvdisasm wheel in this Python."""
    found = shutil.which("nvdisasm")
    candidates = [found] if found else []
    for home in (os.environ.get("CUDA_HOME"), *sorted(glob.glob("/usr/local/cuda*"), reverse=True)):
        if home:
            candidates.append(os.path.join(home, "bin", "nvdisasm"))
    for path in sys.path:
        candidates += sorted(glob.glob(os.path.join(path, "nvidia", "*", "bin", "nvdisasm")), reverse=True)
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    raise SystemExit("bench/sass.py: nvdisasm not found: `python3 -m pip install nvidia-cuda-nvdisasm` (no "
                     "toolkit needed) or put CUDA's bin on PATH")


def parse_sass(text: str) -> dict:
    """{kernel: [instruction, ...]} from `nvdisasm -c` output: each instruction without its address, and the
    unit's name left out of the symbols it names (labels stay; they are numbered within the unit)."""
    kernels, current = {}, None
    for line in text.splitlines():
        m = _FUNC.match(line.strip())
        if m:
            current = _ANON.sub("<unit>", m.group(1))
            kernels[current] = []
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            kernels[current].append(_ANON.sub("<unit>", " ".join(m.group(1).split())))
    return kernels


def opcode_counts(instructions: list) -> collections.Counter:
    """Counts of each opcode's base (MUFU.EX2 -> MUFU), predicates dropped."""
    counts = collections.Counter()
    for ins in instructions:
        op = ins.split()[1] if ins.startswith("@") else ins.split()[0]
        counts[op.split(".")[0]] += 1
    return counts


def records_of(tree: Path, test_records: bool) -> dict:
    names = MANIFESTS + ((TEST_MANIFEST,) if test_records else ())
    recs = {}
    for m in names:
        path = tree / m
        if path.is_file():
            for r in json.loads(path.read_text())["records"]:
                recs[f"{r['program']}/{r['form']}"] = r
    return recs


def select(recs: dict, wanted: list) -> list:
    """Keys of recs named by `wanted` (program or program/form), in manifest order."""
    keys = [k for k in recs if any(k == w or k.split("/")[0] == w for w in wanted)]
    missing = [w for w in wanted if not any(k == w or k.split("/")[0] == w for k in recs)]
    if missing:
        raise SystemExit(f"bench/sass.py: no record {', '.join(missing)} (records: {', '.join(recs)})")
    return keys


def disassemble(tree: Path, rec: dict, work: Path, nvdisasm: str) -> dict:
    """The record's kernels as parse_sass gives them, compiled from `tree`'s rendered unit and templates."""
    cubin = work / f"{rec['name']}.cubin"
    flags = [f for f in rec["flags"] if not f.startswith("-Xcompiler")]  # host flags: no device code
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    proc = subprocess.run([nvcc, *flags, "-cubin", "-I", str(tree / "templates"),
                           str(tree / "generated" / f"{rec['name']}_kernel.cu"), "-o", str(cubin)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{rec['program']}/{rec['form']}: nvcc failed\n{proc.stderr}")
    out = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    return parse_sass(out)


def tree_at(rev: str, into: Path) -> Path:
    """The manifests, templates and generated units of git revision `rev`, unpacked under `into`."""
    paths = [p for p in (*MANIFESTS, TEST_MANIFEST, "templates", "generated")
             if subprocess.run(["git", "cat-file", "-e", f"{rev}:{p}"], cwd=ROOT, capture_output=True).returncode == 0]
    archive = into / "tree.tar"
    subprocess.run(["git", "archive", "-o", str(archive), rev, *paths], cwd=ROOT, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "tree", filter="data")
    return into / "tree"


def summary(kernels: dict) -> str:
    rows = []
    for name, ins in kernels.items():
        c = opcode_counts(ins)
        rows.append(f"  {name[:90]}: {len(ins)} instructions; "
                    + " ".join(f"{op} {c[op]}" for op in COUNTED if c[op]))
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", nargs="*", help="program or program/form")
    ap.add_argument("--all", action="store_true", help="every record")
    ap.add_argument("--test-records", action="store_true", help="build.test.json's records too")
    ap.add_argument("--against", metavar="REV", help="compare with the same records at git revision REV")
    args = ap.parse_args(argv)
    if not args.records and not args.all:
        ap.error("name records, or --all")
    nvdisasm = find_nvdisasm()
    recs = records_of(ROOT, args.test_records)
    keys = list(recs) if args.all else select(recs, args.records)
    changed = 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        old_tree = tree_at(args.against, work) if args.against else None
        old_recs = records_of(old_tree, args.test_records) if old_tree else {}
        for key in keys:
            new = disassemble(ROOT, recs[key], work, nvdisasm)
            if old_tree is None:
                print(f"{key} ({recs[key]['name']})\n{summary(new)}")
                continue
            if key not in old_recs:
                print(f"{key}: no such record at {args.against}\n{summary(new)}")
                changed += 1
                continue
            if old_recs[key]["name"] == recs[key]["name"]:
                print(f"{key}: same unit ({recs[key]['name']}): identical")
                continue
            old = disassemble(old_tree, old_recs[key], work, nvdisasm)
            same = old == new
            changed += not same
            print(f"{key} ({old_recs[key]['name']} -> {recs[key]['name']}): "
                  + ("identical machine code" if same else "machine code differs"))
            if not same:
                for name in sorted(set(old) | set(new)):
                    a, b = old.get(name, []), new.get(name, [])
                    if a != b:
                        ca, cb = opcode_counts(a), opcode_counts(b)
                        moved = {op: cb[op] - ca[op] for op in set(ca) | set(cb) if cb[op] != ca[op]}
                        print(f"  {name[:90]}: {len(a)} -> {len(b)} instructions; moved: "
                              + (" ".join(f"{op} {d:+d}" for op, d in sorted(moved.items())) or "the same opcode counts"))
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
