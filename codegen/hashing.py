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
import re

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


def our_includes(text: str, seen: dict[str, str]) -> None:
    """Add every `#include "x"` and `{% include "x" %}` that resolves under templates/ (recursively) to `seen`."""
    for name in _INCLUDE.findall(text) + _JINJA_INCLUDE.findall(text):
        path = TEMPLATES / name
        if not path.is_file():
            continue  # not ours (e.g. a system or pybind11 header in quotes)
        key = _rel(path)
        if key in seen:
            continue
        data = path.read_bytes()
        seen[key] = sha256_bytes(data)
        our_includes(data.decode(), seen)


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
