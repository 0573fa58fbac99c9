"""Codegen: check/render round trips, determinism, hashing inputs, manifests, stale refusal."""
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace

import jinja2
import pytest

from codegen import ROOT
from codegen.catalog import RECORDS
from codegen.hashing import record_hash
from codegen.render import expected_tree, render_record

TREE = ("codegen", "templates", "generated", "build.json", "build.test.json", "setup.py", "pyproject.toml")


def run(args, cwd, env=None):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


@pytest.fixture
def repo_copy(tmp_path):
    for name in TREE:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, tmp_path / name)
    return tmp_path


def test_checked_in_tree_is_current():
    proc = run(["-m", "codegen", "check"], ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_render_is_deterministic_across_hash_seeds():
    dump = "import json, sys; from codegen.render import expected_tree; json.dump(expected_tree(), sys.stdout)"
    outs = [run(["-c", dump], ROOT, {"PYTHONHASHSEED": seed}) for seed in ("0", "1", "98765")]
    for p in outs:
        assert p.returncode == 0, p.stderr
    assert outs[0].stdout == outs[1].stdout == outs[2].stdout


def test_no_absolute_paths_or_timestamps():
    for path, text in expected_tree().items():
        assert str(ROOT) not in text, path
        assert "/root/" not in text and "/home/" not in text, path


def test_check_reports_stale_missing_orphan_and_render_repairs(repo_copy):
    gen = sorted((repo_copy / "generated").iterdir())
    gen[0].write_text(gen[0].read_text() + "// edited by hand\n")
    gen[1].unlink()
    (repo_copy / "generated" / "deadbeefdeadbeef_kernel.cu").write_text("// orphan\n")
    proc = run(["-m", "codegen", "check"], repo_copy)
    assert proc.returncode == 1
    assert f"stale: generated/{gen[0].name}" in proc.stdout
    assert "+// edited by hand" not in proc.stdout and "-// edited by hand" in proc.stdout  # a readable diff
    assert f"missing: generated/{gen[1].name}" in proc.stdout
    assert "orphan: generated/deadbeefdeadbeef_kernel.cu" in proc.stdout
    assert run(["-m", "codegen", "render"], repo_copy).returncode == 0
    assert run(["-m", "codegen", "check"], repo_copy).returncode == 0
    # render writes only what changed: a second render touches nothing
    assert run(["-m", "codegen", "render"], repo_copy).stdout == ""


@pytest.mark.parametrize("header", ["conv1d_silu.h", "conv1d_silu.cuh", "wgmma.cuh"])
def test_template_or_header_edit_renames_records(repo_copy, header):
    """An edit of a header renames every record that includes it, directly or through another header, from
    a kernel or a binding template (conv1d_silu.cuh and wgmma.cuh are included after a Jinja tag on the
    line), and no other record."""
    from codegen.hashing import dependencies
    path = repo_copy / "templates" / "common" / header
    path.write_text(path.read_text() + "\n// a change\n")
    proc = run(["-m", "codegen", "check"], repo_copy)
    assert proc.returncode == 1
    users = [r for r in RECORDS if f"templates/common/{header}" in dependencies(r)]
    expected = {"conv1d_silu.h": ("conv1d_silu",), "conv1d_silu.cuh": ("conv1d_silu",),
                "wgmma.cuh": ("kda_fwd_walk", "kda_bwd_walk")}[header]
    for program in expected:
        n = sum(r.program.startswith(program) for r in RECORDS)
        assert n and sum(r.program.startswith(program) for r in users) == n, (header, program)
    assert proc.stdout.count("missing: generated/") == 2 * len(users)
    assert proc.stdout.count("orphan: generated/") == 2 * len(users)
    assert "stale: build.json" in proc.stdout


def test_rendered_includes_are_hash_inputs():
    """Every header of ours that a rendered unit includes is an input of its record's hash (the hash reads the
    templates, not the rendered text: an include the hash's pattern missed would let a header edit keep the
    record's name and its stale object)."""
    import re
    from codegen import TEMPLATES
    from codegen.hashing import dependencies
    include = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
    for rec in RECORDS:
        deps = dependencies(rec)
        for text in render_record(rec).files.values():
            for name in include.findall(text):  # every quoted include is ours (hashing refuses any other)
                assert (TEMPLATES / name).is_file() and f"templates/{name}" in deps, (rec.program, rec.form, name)


def test_includes_resolve_as_nvcc_resolves_them(tmp_path, monkeypatch):
    """A header's quoted include resolves beside it first, then under templates/ (nvcc's order), and each
    resolved header is a hash input; one that resolves nowhere is an error, not a header left out of the hash."""
    from codegen import hashing
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "a.cuh").write_text('#include "b.h"\n')
    (tmp_path / "common" / "b.h").write_text('#include "common/c.h"\n')
    (tmp_path / "common" / "c.h").write_text("// c\n")
    monkeypatch.setattr(hashing, "TEMPLATES", tmp_path)
    monkeypatch.setattr(hashing, "_rel", lambda path: path.relative_to(tmp_path).as_posix())
    seen = {}
    hashing.our_includes('#include "common/a.cuh"\n', seen)
    assert sorted(seen) == ["common/a.cuh", "common/b.h", "common/c.h"]
    with pytest.raises(FileNotFoundError, match=r'#include "b.h" \(in a template\) is no file under templates/'):
        hashing.our_includes('#include "b.h"\n', {})  # a template's unit is compiled in generated/, not common/
    (tmp_path / "common" / "c.h").write_text('#include "cuda_bf16.h"\n')
    with pytest.raises(FileNotFoundError, match=r'"cuda_bf16.h" \(in common\)'):
        hashing.our_includes('#include "common/a.cuh"\n', {})
    # a Jinja partial's text is rendered into the unit (compiled in generated/): its quoted includes resolve under
    # templates/, not beside the partial
    (tmp_path / "prog").mkdir()
    (tmp_path / "prog" / "part.cuh.j2").write_text('#include "local.h"\n')
    (tmp_path / "prog" / "local.h").write_text("// beside the partial: not what nvcc finds\n")
    with pytest.raises(FileNotFoundError, match=r'"local.h" \(in a template\)'):
        hashing.our_includes('{% include "prog/part.cuh.j2" %}\n', {})


def test_manifest_edit_is_detected(repo_copy):
    doc = json.loads((repo_copy / "build.json").read_text())
    doc["records"][0]["params"]["threads"] = 1
    (repo_copy / "build.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    proc = run(["-m", "codegen", "check"], repo_copy)
    assert proc.returncode == 1 and "stale: build.json" in proc.stdout


def test_hash_covers_params_arch_and_flags():
    rec = RECORDS[0]
    base = record_hash(rec)
    assert record_hash(replace(rec, params={**rec.params, "threads": rec.params["threads"] * 2})) != base
    assert record_hash(replace(rec, arch="sm_100a")) != base
    assert record_hash(replace(rec, extra_flags=("-DX=1",))) != base
    assert record_hash(replace(rec, select="another rule")) == base  # not an input of the files


def test_kda_bindings_come_from_their_argument_struct(monkeypatch):
    """The KDA programs' binding units render from the one KDA binding template, on their argument struct,
    with the tensors BINDINGS lists for them; those are an input of the hash."""
    from codegen import catalog
    for rec in RECORDS:
        if rec.program.startswith(("kda_", "kcp_")):
            assert rec.templates["binding.cpp"] == "common/kda_binding.cpp.j2", rec.program
            text = render_record(rec).files[f"generated/{record_hash(rec)[:16]}_binding.cpp"]
            assert f"const kda::Kda{rec.binding.args}Args* args" in text, rec.program
            assert ", ".join(f'"{n}"' for n in rec.binding.needs) in text
            assert "{" + ", ".join(f'"{n}"' for n in rec.binding.need_one) + "}" in text
    rec = next(r for r in RECORDS if r.program == "kda_fwd_walk")
    base = record_hash(rec)
    changed = {tuple: lambda x: x[:-1] if x else ("q",), bool: lambda x: not x,
               str: lambda x: catalog._BWD_ARGS if x == catalog._FWD_ARGS else catalog._FWD_ARGS}  # the struct
    for f in dataclasses.fields(rec.binding):  # every field, so that a new one cannot be left out of the hash
        value = getattr(rec.binding, f.name)
        monkeypatch.setitem(catalog.BINDINGS, "kda_fwd_walk", replace(rec.binding, **{f.name: changed[type(value)](value)}))
        assert record_hash(rec) != base, f.name


def test_one_arch_table():
    """The archs records are rendered for (codegen.catalog.ARCHS) are the archs the runtime maps GPUs to
    (kda_aot/_runtime/arch.py, which setup.py reads too), and the arch built without a GPU is one of them."""
    from codegen import catalog
    from kda_aot._runtime import arch
    assert set(catalog.ARCHS) == set(arch.CAPABILITY_ARCH.values())
    assert arch.DEFAULT_ARCH in catalog.ARCHS
    assert {r.arch for r in RECORDS} <= set(catalog.ARCHS)


def test_missing_parameter_is_an_error():
    rec = RECORDS[0]
    params = dict(rec.params)
    params.pop("tokens_per_thread")
    with pytest.raises(jinja2.UndefinedError):
        render_record(replace(rec, params=params))


def test_manifests_list_every_record_with_file_hashes():
    shipped = json.loads((ROOT / "build.json").read_text())
    test_only = json.loads((ROOT / "build.test.json").read_text())
    assert shipped["shipped"] is True and test_only["shipped"] is False
    entries = shipped["records"] + test_only["records"]
    assert len(entries) == len(RECORDS)
    assert {(e["program"], e["form"]) for e in shipped["records"]} == {
        (r.program, r.form) for r in RECORDS if r.shipped}
    for e in entries:
        for key in ("name", "hash", "program", "form", "arch", "template", "binding", "params", "select", "grid",
                    "files", "depends", "flags", "toolkit_floor", "module"):
            assert key in e, (e["name"], key)
        assert e["hash"].startswith(e["name"])
        assert (ROOT / e["template"] / "kernel.cu.j2").is_file()
        assert (ROOT / e["binding"]).is_file() and e["binding"] in e["depends"]
        for path, digest in list(e["files"].items()) + list(e["depends"].items()):
            assert hashlib.sha256((ROOT / path).read_bytes()).hexdigest() == digest, path
        assert any(p.startswith("templates/common/") for p in e["depends"])  # our headers are inputs


def test_setup_refuses_a_stale_tree(repo_copy):
    pytest.importorskip("setuptools", reason="setup.py needs setuptools (a build tool, not the package's)")
    gen = sorted((repo_copy / "generated").glob("*_kernel.cu"))[0]
    gen.write_text(gen.read_text() + "// edited\n")
    proc = run(["setup.py", "build_ext", "--inplace"], repo_copy, {"KDA_AOT_ARCH": "sm_90a"})
    assert proc.returncode != 0
    assert "generated/ is stale" in proc.stdout + proc.stderr


def test_included_template_variants_are_hash_inputs():
    """A walk's step kinds live in files of their own, `{% include %}`d by its kernel template: each is
    a dependency of every record of the program (a change to either changes the hash)."""
    from codegen.hashing import dependencies
    for program, files in (("kda_fwd_walk", ("step_column_halves", "step_roles")),
                           ("kda_bwd_walk", ("wgmma_stage", "wgmma_walk", "mma_stage", "mma_walk"))):
        for rec in (r for r in RECORDS if r.program == program):
            deps = dependencies(rec)
            for name in files:
                assert f"templates/{program}/{name}.cuh.j2" in deps, (rec.form, name)
