"""Content hash of a record: everything that decides its generated files, nothing else.

Inputs: the record's template files (its kernel's and its binding's), every header and template of ours
they include (transitively, by relative path under templates/), the tensors its binding requires, the parameters,
the arch and the flags. No absolute paths,
no timestamps, keys sorted: the hash is the same on any machine and under any PYTHONHASHSEED.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path

from . import TEMPLATES
from .catalog import Record

# anywhere on a line: a template may open a line with a Jinja tag (`{% if wgmma %}#include "common/wgmma.cuh"`)
_INCLUDE = re.compile(r'#\s*include\s+"([^"]+)"')
# a template's variants in files of their own (include, import, extends, from; either quote)
_JINJA_INCLUDE = re.compile(r"""\{%[-+]?\s*(?:include|import|extends|from)\s+["']([^"']+)["']""")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _rel(path) -> str:
    return path.relative_to(TEMPLATES.parent).as_posix()


def our_includes(text: str, seen: dict[str, str], where=None) -> None:
    """Add every `#include "x"` and `{% include "x" %}` of `text` to `seen`, recursively. A quoted include resolves
    as nvcc resolves it: beside the including header (`where`, its folder; None for a template, whose rendered
    unit lives in generated/), then under templates/ (-I templates). One that resolves to no file of ours is an
    error: a header the hash cannot read would let its edits keep the record's name. (System and CUDA headers are
    included with <>.)"""
    names = [(name, True) for name in _INCLUDE.findall(text)] + [(name, False) for name in _JINJA_INCLUDE.findall(text)]
    for name, quoted in names:
        candidates = ([where / name] if quoted and where is not None else []) + [TEMPLATES / name]
        path = next((c for c in candidates if c.is_file()), None)
        if path is None:
            raise FileNotFoundError(f"codegen: {'#include' if quoted else 'a Jinja include of'} \"{name}\" "
                                    f"(in {_rel(where) if where is not None else 'a template'}) is no file under "
                                    f"templates/; system headers go in <>")
        key = _rel(Path(os.path.normpath(path)))
        if key in seen:
            continue
        data = path.read_bytes()
        seen[key] = sha256_bytes(data)
        # a Jinja partial's text lands in the rendered unit: its own includes resolve as the unit's do
        our_includes(data.decode(), seen, path.parent if quoted else where)


def dependencies(record: Record) -> dict[str, str]:
    """{relative path: sha256} of the template files and the headers they include."""
    deps: dict[str, str] = {}
    for template in record.templates.values():
        path = TEMPLATES / template
        data = path.read_bytes()
        deps[_rel(path)] = sha256_bytes(data)
        our_includes(data.decode(), deps)
    return dict(sorted(deps.items()))


def record_hash(record: Record) -> str:
    payload = {
        "program": record.program,
        "form": record.form,
        "arch": record.arch,
        "params": record.params,
        "flags": list(record.flags),
        "depends": dependencies(record),
    }
    if record.binding:  # every field of its binding (tensors required, activations taken) is rendered into it
        payload["binding"] = dataclasses.asdict(record.binding)
    canon = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return sha256_bytes(canon.encode())
