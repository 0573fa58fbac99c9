"""The benchmarks: `python -m bench ...` from the checkout root; not part of the wheel."""
