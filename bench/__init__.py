"""The benchmarks (DESIGN.md §5): `python -m bench ...` from the checkout root; not part of the wheel."""
