"""python -m codegen render | check | list"""
from __future__ import annotations

import argparse
import difflib
import sys

from . import GENERATED, ROOT
from .render import actual_tree, expected_tree, render_all

MAX_DIFF_LINES = 60


def differences(expected: dict, actual: dict) -> list[tuple[str, str]]:
    """[(kind, path)] with kind in stale | missing | orphan."""
    out = []
    for path in sorted(set(expected) | set(actual)):
        if path not in actual:
            out.append(("missing", path))
        elif path not in expected:
            out.append(("orphan", path))
        elif expected[path] != actual[path]:
            out.append(("stale", path))
    return out


def cmd_render() -> int:
    expected = expected_tree()
    actual = actual_tree()
    GENERATED.mkdir(exist_ok=True)
    for kind, path in differences(expected, actual):
        target = ROOT / path
        if kind == "orphan":
            target.unlink()
        else:
            target.write_text(expected[path], newline="\n")
        print(f"{kind:8s} {path}: {'removed' if kind == 'orphan' else 'written'}")
    return 0


def cmd_check() -> int:
    expected = expected_tree()
    actual = actual_tree()
    diffs = differences(expected, actual)
    if not diffs:
        print(f"codegen check: {len(expected)} files up to date")
        return 0
    for kind, path in diffs:
        print(f"{kind}: {path}")
        if kind == "stale":
            lines = list(difflib.unified_diff(actual[path].splitlines(), expected[path].splitlines(),
                                              f"{path} (on disk)", f"{path} (rendered)", lineterm=""))
            print("\n".join(lines[:MAX_DIFF_LINES]))
            if len(lines) > MAX_DIFF_LINES:
                print(f"... {len(lines) - MAX_DIFF_LINES} more diff lines")
    print(f"codegen check: {len(diffs)} difference(s); run `python -m codegen render`", file=sys.stderr)
    return 1


def cmd_list() -> int:
    print(f"{'name':16s}  {'program':18s} {'form':12s} {'arch':7s} {'ships':5s} params")
    for r in render_all():
        rec = r.record
        print(f"{r.name:16s}  {rec.program:18s} {rec.form:12s} {rec.arch:7s} "
              f"{'yes' if rec.shipped else 'test':5s} {rec.params}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m codegen", description=__doc__)
    parser.add_argument("verb", choices=("render", "check", "list"))
    args = parser.parse_args(argv)
    return {"render": cmd_render, "check": cmd_check, "list": cmd_list}[args.verb]()


if __name__ == "__main__":
    sys.exit(main())
