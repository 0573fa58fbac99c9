"""Codegen for kda_aot: renders Jinja templates into content-hashed CUDA units.

catalog  - every record (program, form, arch, parameters) in one table
hashing  - content hash of a record's inputs (templates, our headers, parameters, arch, flags)
render   - Jinja rendering of a record into its kernel unit and binding unit, and the manifests
           (build.json / build.test.json)
__main__ - the CLI: ``python -m codegen render | check | list``
"""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "templates"
GENERATED = ROOT / "generated"
MANIFEST_SHIPPED = ROOT / "build.json"
MANIFEST_TEST = ROOT / "build.test.json"
