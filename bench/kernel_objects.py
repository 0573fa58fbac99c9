"""Compile every record's kernel unit (nvcc, no GPU needed) into build/obj, as setup.py would, and
gather the current records' objects in build/kobj for a device call to carry: the device then links
them and compiles only the binding units (python 3.12 there). Objects are keyed by record hash, so a
stale one is never picked up. -Xptxas -v output (registers, spills) goes to build/kobj/ptxas.txt."""
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def compile_one(rec: dict) -> str:
    obj = ROOT / "build" / "obj" / f"{rec['name']}_kernel.o"
    if obj.exists():
        return ""
    tmp = obj.with_suffix(".tmp.o")
    proc = subprocess.run(["nvcc", *rec["flags"], "-Xptxas", "-v", "-I", str(ROOT / "templates"), "-c",
                           str(ROOT / "generated" / f"{rec['name']}_kernel.cu"), "-o", str(tmp)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{rec['program']}/{rec['form']}: nvcc failed\n{proc.stderr}")
    tmp.replace(obj)
    return f"== {rec['program']}/{rec['form']} ({rec['name']})\n{proc.stderr}"


def main() -> None:
    records = [r for m in ("build.json", "build.test.json") for r in json.loads((ROOT / m).read_text())["records"]]
    (ROOT / "build" / "obj").mkdir(parents=True, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        logs = list(pool.map(compile_one, records))
    kobj = ROOT / "build" / "kobj"
    shutil.rmtree(kobj, ignore_errors=True)
    kobj.mkdir(parents=True)
    for r in records:
        shutil.copy(ROOT / "build" / "obj" / f"{r['name']}_kernel.o", kobj)
    (kobj / "ptxas.txt").write_text("".join(logs))
    print("".join(logs) or "all kernel objects up to date")


if __name__ == "__main__":
    main()
