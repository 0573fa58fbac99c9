"""The fit rule: which form of a state walk to launch (DESIGN.md §3, issue 5).

A walk launch is a set of chains (one per (segment, head)), each `n` chunks long. `full` runs one
CTA per chain and one CTA per SM; `split` runs two CTAs per chain (64 value columns each) and two
CTAs per SM. A split step costs `rho` of a full step when two split CTAs share an SM, and
`rho_alone` when the launch has at most one split CTA per SM (2 x chains <= SMs: the block
scheduler spreads them, each has its SM to itself). List-schedule the chains longest first on the
slots of each form and take the form with the shorter predicted makespan (ties keep `full`).

Both are measured per program on the GPU (bench/measure_rho.py writes kda_aot/fit_params.json);
while a program has no measurement, `auto` keeps `full` and says so in the log. Decisions are
cached per (program, chain lengths, H, SM count, knob); every launch can be logged as
(program, form, chains) on the `kda_aot.fit` logger at DEBUG level.
"""
from __future__ import annotations

import functools
import heapq
import json
import logging
import os
from pathlib import Path

FORMS = ("full", "split")
KNOBS = ("auto",) + FORMS
PARAMS_FILE = Path(__file__).with_name("fit_params.json")
log = logging.getLogger("kda_aot.fit")


def makespan(chain_steps: list[float], slots: int) -> float:
    """Longest-first list scheduling of chains (their step counts) on `slots` identical slots."""
    if not chain_steps:
        return 0.0
    loads = [0.0] * max(1, slots)
    for steps in sorted(chain_steps, reverse=True):
        heapq.heappush(loads, heapq.heappop(loads) + steps)
    return max(loads)


def predicted(chain_lengths: tuple, heads: int, sm_count: int, rho: float, rho_alone: float | None = None) -> dict:
    """Predicted makespans, in full-form chunk steps, of the two forms for one launch."""
    chains = [float(n) for n in chain_lengths for _ in range(heads)]
    if rho_alone is not None and 2 * len(chains) <= sm_count:
        split = rho_alone * max(chains, default=0.0)  # one split CTA per SM
    else:  # every chain becomes two half-width chains of rho-cost steps, two slots per SM
        split = makespan([rho * n for n in chains for _ in range(2)], 2 * sm_count)
    return {"full": makespan(chains, sm_count), "split": split}


@functools.lru_cache(maxsize=None)
def measured_rho() -> dict:
    """{program: (rho, rho_alone)} from fit_params.json (empty until measured; rho_alone = rho
    when a measurement predates it)."""
    if not PARAMS_FILE.is_file():
        return {}
    progs = json.loads(PARAMS_FILE.read_text())["programs"]
    return {p: (float(v["rho"]), float(v.get("rho_alone", v["rho"]))) for p, v in progs.items()}


@functools.lru_cache(maxsize=4096)
def _decide(program: str, chain_lengths: tuple, heads: int, sm_count: int, knob: str) -> str:
    if knob in FORMS:
        return knob
    rhos = measured_rho().get(program)
    if rhos is None:
        log.info("%s: rho not measured on this GPU yet (bench/measure_rho.py); keeping the full form", program)
        return "full"
    spans = predicted(chain_lengths, heads, sm_count, *rhos)
    return "split" if spans["split"] < spans["full"] else "full"


def choose_form(program: str, chain_lengths, heads: int, sm_count: int, knob: str | None = None) -> str:
    """The form to launch. knob: auto | full | split (default: env KDA_AOT_WALK_FORM, else auto)."""
    knob = knob or os.environ.get("KDA_AOT_WALK_FORM", "auto")
    if knob not in KNOBS:
        raise ValueError(f"walk_form: expected one of {KNOBS}, got {knob!r}")
    form = _decide(program, tuple(int(n) for n in chain_lengths), int(heads), int(sm_count), knob)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("launch %s form=%s chains=%d", program, form, len(chain_lengths) * heads)
    return form
