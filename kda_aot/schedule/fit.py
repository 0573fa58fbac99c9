"""The fit rule: which form of a state walk to launch (docs/fit_rule.md).

A walk launch is a set of chains (one per (segment, head)), each `n` chunks long. `full` runs one
CTA per chain and one CTA per SM; `split` runs two CTAs per chain (64 value columns each) and two
CTAs per SM; `quarter` four CTAs of 32 columns, each alone on its SM. A split step costs `rho` of a
full step when two split CTAs share an SM, and `rho_alone` when the launch has at most one split
CTA per SM (2 x chains <= SMs: the block scheduler spreads them, each has its SM to itself).
List-schedule the chains on the slots of each form and take the form with the shorter predicted
makespan (ties keep `full`).

The chains are scheduled in the order the GPU takes them: the block scheduler hands out a launch's
CTAs in blockIdx order (segment fastest, then head, then column group) to whichever slot frees
first; it does not sort them longest first. The two orders agree while every chain gets a slot at
once; they part when chains queue, and then only launch order predicts what the GPU runs
(docs/fit_rule.md, "Tried and did not pay").

A launch may also mix the forms: the k longest documents split (each split CTA alone on its SM,
`rho_alone`), the others full on the SMs left over. The walk then runs as one launch per run of
consecutive segments of one form, each on its own stream so that they overlap (at most MAX_RUNS;
split runs first, then the full runs in segment order: the order their CTAs are taken in).
Every chain computes the same values in either form, so any plan gives bitwise the same result.

Both are measured per program on each GPU (bench/measure_rho.py writes the table of the GPU it runs on,
kda_aot/schedule/fit_params/<gpu>.json, which ships with the package beside the pipeline's costs; the
H200's table missing is an error, a GPU without a table gets none: its `auto` keeps `full`, and the
pipeline its plain SM split, and the log says so); while a program has no entry, `auto` keeps `full`
and says so in the log. Decisions are
cached per (program, chain lengths, H, SM count, walk_form); every launch can be logged as
(program, form, chains) on the `kda_aot.schedule.fit` logger at DEBUG level.
"""
from __future__ import annotations

import functools
import heapq
import json
import logging
import re
from pathlib import Path

from .. import options
from . import grouping

# quarter (four CTAs of 32 columns): `auto` considers it only for a program whose fit_params entry
# has rho_quarter_alone and whose quarter record ships (QUARTER_SHIPPED, checked against build.json
# by tests/test_fit.py), and only when every quarter CTA gets an SM of its own.
FORMS = options.WALK_FORMS[1:]  # full, split, quarter
QUARTER_SHIPPED: frozenset = frozenset({"kda_fwd_walk", "kda_bwd_walk"})  # quarter in build.json
PARAMS_DIR = Path(__file__).with_name("fit_params")
MEASURED_GPU = "NVIDIA H200"  # the GPU whose table must ship
PARAMS_FILE: Path | None = None  # a table to use instead of the current GPU's (tests, measure_rho --out)
log = logging.getLogger(__name__)


def makespan(chain_steps: list[float], slots: int) -> float:
    """List scheduling of chains (their step costs) on `slots` identical slots in the order given:
    each chain starts on the slot that frees first (the block scheduler's rule)."""
    if not chain_steps:
        return 0.0
    loads = [0.0] * max(1, slots)
    for steps in chain_steps:
        heapq.heappush(loads, heapq.heappop(loads) + steps)
    return max(loads)


def launch_order(chain_lengths, heads: int, first: int = 0, end: int | None = None) -> list[float]:
    """The chains of a launch over segments [first, end) in blockIdx order: segment fastest, then head."""
    seg = [float(n) for n in chain_lengths[first:end]]
    return [n for _ in range(heads) for n in seg]


def predicted(chain_lengths: tuple, heads: int, sm_count: int, rho: float, rho_alone: float | None = None,
              rho_quarter_alone: float | None = None) -> dict:
    """Predicted makespans, in full-form chunk steps, of the uniform forms for one launch (quarter
    only when its step cost is given and each of its CTAs gets an SM of its own)."""
    chains = launch_order(chain_lengths, heads)
    if rho_alone is not None and 2 * len(chains) <= sm_count:
        split = rho_alone * max(chains, default=0.0)  # one split CTA per SM
    else:  # two half-width CTAs per chain (column group slowest in blockIdx), two slots per SM
        split = makespan([rho * n for n in chains] * 2, 2 * sm_count)
    spans = {"full": makespan(chains, sm_count), "split": split}
    if rho_quarter_alone is not None and 4 * len(chains) <= sm_count:
        spans["quarter"] = rho_quarter_alone * max(chains, default=0.0)
    return spans


def gpu_key(name: str) -> str:
    """The table name of a GPU: "NVIDIA H200" -> "nvidia_h200"."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


@functools.lru_cache(maxsize=None)
def current_gpu() -> str:
    """The current CUDA device's name; without a GPU, the measured one (plans printed on the CPU)."""
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else MEASURED_GPU


def params_file(gpu: str | None = None) -> Path:
    """The table of `gpu` (default: the current one), or PARAMS_FILE when set."""
    if PARAMS_FILE is not None and gpu is None:
        return PARAMS_FILE
    return PARAMS_DIR / f"{gpu_key(gpu or current_gpu())}.json"


@functools.lru_cache(maxsize=None)
def _table(path: Path) -> dict:
    """A fit_params table, read once per path. The measured GPU's ships with the package: without it every
    `auto` launch would quietly keep `full`. Another GPU without a table runs on the rule's defaults."""
    if not path.is_file():
        if PARAMS_FILE is None and path.stem != gpu_key(MEASURED_GPU):
            log.warning("kda_aot fit rule: no table for this GPU (%s): walks stay full, the pipeline's walks "
                        "keep their SMs; measure one with bench/measure_rho.py", path.name)
            return {"programs": {}, "pipeline": {}}
        raise FileNotFoundError(f"kda_aot.schedule.fit: {path} is missing (it ships with kda_aot: reinstall "
                                f"the package, or restore it in a source checkout)")
    return json.loads(path.read_text())


def _params(path: Path) -> dict:
    """The programs' entries of a table (empty until measured)."""
    return _table(path).get("programs", {})


def pipeline_params() -> dict:
    """The pipeline's costs on the current GPU: chunk_stage_us_per_chunk_head (the chunk stage per (chunk,
    head) on the whole GPU), chunk_stage_slowdown_beside_walk ({walks at once: factor}: a walk CTA on an SM
    leaves shared memory for one chunk-stage CTA instead of two), bwd_chunk_us_per_chunk_head; empty when
    the GPU has no table."""
    p = _table(params_file()).get("pipeline", {})
    if not p:
        return {}
    return {"chunk_stage_us_per_chunk_head": float(p["chunk_stage_us_per_chunk_head"]),
            "chunk_stage_slowdown_beside_walk": {int(k): float(v) for k, v in p["chunk_stage_slowdown_beside_walk"].items()},
            "bwd_chunk_us_per_chunk_head": float(p["bwd_chunk_us_per_chunk_head"])}


@functools.lru_cache(maxsize=None)
def measured_rho() -> dict:
    """{program: (rho, rho_alone, rho_quarter_alone or None)} from the GPU's fit_params table (empty
    until measured; rho_alone = rho when an entry lacks it; quarter only where it ships)."""
    progs = _params(params_file())
    return {p: (float(v["rho"]), float(v.get("rho_alone", v["rho"])),
                float(v["rho_quarter_alone"]) if p in QUARTER_SHIPPED and "rho_quarter_alone" in v else None)
            for p, v in progs.items()}


# launches of one walk (one stream each): the split run and one full run; a third's launch and fork cost more
# than the rule's model prices (docs/fit_rule.md)
MAX_RUNS = 2
MIXED_GAIN = 0.95  # a mixed plan (extra launches, a stream fork and join) must beat uniform by 5 %


def mixed_makespan(chain_lengths: tuple, heads: int, sm_count: int, split: set, rho_alone: float):
    """Predicted makespan with the segments in `split` split (each split CTA alone on its SM) and the
    rest full on the SMs left over, the full runs' CTAs taken in launch order; None when they do
    not fit so (no SM left for the full chains)."""
    free = sm_count - 2 * len(split) * heads
    if free <= 0 or not split:
        return None
    runs = grouping.runs_of(["split" if s in split else "full" for s in range(len(chain_lengths))])
    full = [n for form, a, b in runs if form == "full" for n in launch_order(chain_lengths, heads, a, b)]
    return max(rho_alone * max(chain_lengths[s] for s in split), makespan(full, free))


@functools.lru_cache(maxsize=4096)
def _decide(program: str, chain_lengths: tuple, heads: int, sm_count: int, walk_form: str) -> tuple:
    n = len(chain_lengths)
    if walk_form in FORMS:
        return ((walk_form, 0, n),)
    rhos = measured_rho().get(program)
    if rhos is None:
        log.info("%s: rho not measured on this GPU yet (bench/measure_rho.py); keeping the full form", program)
        return (("full", 0, n),)
    spans = predicted(chain_lengths, heads, sm_count, *rhos)
    best_span, best = spans["full"], (("full", 0, n),)
    for form in ("split", "quarter"):
        if form in spans and spans[form] < best_span:
            best_span, best = spans[form], ((form, 0, n),)
    longest_first = sorted(range(n), key=lambda s: -chain_lengths[s])
    uniform_span = best_span
    for k in range(1, n):  # split the k longest documents, the others full
        chosen = set(longest_first[:k])
        span = mixed_makespan(chain_lengths, heads, sm_count, chosen, rhos[1])
        if span is None:
            break
        runs = grouping.runs_of(["split" if s in chosen else "full" for s in range(n)])
        if len(runs) <= MAX_RUNS and span < best_span and span < MIXED_GAIN * uniform_span:
            best_span, best = span, runs
    return best


def plan_walk(program: str, chain_lengths, heads: int, sm_count: int, walk_form: str | None = None) -> tuple:
    """The launches of one walk: ((form, first segment, end segment), ...) covering every segment in
    order. walk_form: auto | full | split | quarter (default: Options.walk_form)."""
    walk_form = walk_form or options.current().walk_form
    if walk_form not in options.WALK_FORMS:
        raise ValueError(f"walk_form: expected one of {options.WALK_FORMS}, got {walk_form!r}")
    plan = _decide(program, tuple(int(n) for n in chain_lengths), int(heads), int(sm_count), walk_form)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("launch %s %s chains=%d", program,
                  " ".join(f"{form}[{a}:{b}]" for form, a, b in plan), len(chain_lengths) * heads)
    return plan


# The pipeline's costs (pipeline_params: the chunk stage per (chunk, head), its slowdown beside the walks,
# kda_bwd_chunk per (chunk, head)) are per GPU, in the fit_params table; their measurements are in
# docs/fit_rule.md.


def walk_step_us(program: str, alone: bool = True) -> float | None:
    """A full-form step of the walk, in microseconds (the GPU's fit_params table), or None: alone on the GPU, or
    (alone=False) beside other CTAs on the SMs, as an earlier group's walk runs beside the chunk stage."""
    entry = _params(params_file()).get(program)
    if entry is None:
        return None
    return 1000.0 * float(entry["full_alone_ms" if alone else "full_ms"]) / float(entry["chunks_per_chain"])


@functools.lru_cache(maxsize=1024)
def pipelined_walk_sms(program: str, chain_lengths: tuple, heads: int, sms: int, group: int,
                       walks_beside: int = 1, first: tuple = (), pieced: int = -1, bwd_chunk: bool = False) -> int:
    """The SMs the walk of pipelined group `group` (plan_pipeline's launch order) is planned on. A walk
    that runs beside the chunk stage of the groups after it gets as many SMs as it has chains (the fit
    rule then keeps one full CTA per chain and leaves the other SMs to the chunk stage) - unless it
    stays the critical path even planned on every SM with the rest of the chunk stage slowed beside
    it (pipeline_params' chunk_stage_slowdown_beside_walk[walks_beside]; walks_beside = 2 in the replay, whose two
    walks run at once):
    then it gets them all: a long walk with little chunk stage left after it gains every SM, while
    walks that start with much of the stage still to run would starve it (docs/fit_rule.md, "The
    pipeline rule, measured"). The last group's walk runs after the chunk stage and gets
    every SM - unless the forward cuts it in pieces (last_group_pieces) and every earlier walk is
    restricted: then its pieces' walks run beside those walks and the later pieces' chunk stage, and
    get one SM per chain too; when an earlier walk took every SM, the last one on every SM pays
    (docs/fit_rule.md). pieced: the group that pieced_group cuts (context parallelism; -1: none), treated
    as such a last group - a CP rank's only chain included, whose pieces' walks would otherwise take every
    SM from the chunk stage of the pieces after them (a walk CTA leaves an SM room for one chunk-stage CTA
    instead of two). A pieced group that is not the last launches its first piece ahead of everything
    (plan._launch_order), so its walk starts with the whole chunk stage but that piece still to run beside
    it (in the replay, whose backward walk goes through the pieces from the back, that walk after the last
    piece too). In the replay (walks_beside = 2) the last group's walks get the SMs that earlier walks are
    predicted not to hold still when they start (_held_by_earlier_walks, which counts the pieced group's
    walks on the SMs this rule gives them) - unless kda_bwd_chunk over the earlier groups' chunks runs beside
    them (bwd_chunk: the replay plan's BwdChunk nodes): then they are planned as an earlier group's walk, that
    kda_bwd_chunk as the work beside them."""
    groups = grouping.plan_pipeline(chain_lengths, first)
    a, b = groups[group]
    restricted = max(1, min(sms, heads * (b - a)))
    if group == len(groups) - 1:
        in_pieces = group == pieced or grouping.last_group_pieces(chain_lengths, first) is not None
        if walks_beside == 1 and in_pieces and all(
                pipelined_walk_sms(program, chain_lengths, heads, sms, g, 1, first, pieced) < sms
                for g in range(group)):
            return restricted
        if walks_beside == 1:  # an earlier walk holds SMs: the last walk on every SM pays (docs/fit_rule.md)
            return sms
        if bwd_chunk:  # every other group's chunks: plan_pipeline orders groups by their longest chain
            walk_us = _walk_on_every_sm_us(program, chain_lengths[a:b], heads, sms, restricted)
            others = (sum(chain_lengths) - sum(chain_lengths[a:b])) * heads
            if walk_us is not None and _outlasts(walk_us, others, "bwd_chunk_us_per_chunk_head", walks_beside):
                return restricted
        return max(restricted, sms - _held_by_earlier_walks(program, chain_lengths, heads, sms, walks_beside, first,
                                                            pieced))
    walk_us = _walk_on_every_sm_us(program, chain_lengths[a:b], heads, sms, restricted)
    if walk_us is None:
        return restricted
    if group == pieced:
        done = grouping.first_piece_chunks(chain_lengths[a]) * (2 if walks_beside == 2 and program == "kda_bwd_walk" else 1)
    else:
        done = sum(chain_lengths[x] for g in groups[:group + 1] for x in range(*g))
    rest = (sum(chain_lengths) - done) * heads
    return restricted if _outlasts(walk_us, rest, "chunk_stage_us_per_chunk_head", walks_beside) else sms


def _walk_on_every_sm_us(program: str, chains: tuple, heads: int, sms: int, restricted: int) -> float | None:
    """The predicted time of the walk of `chains` planned on every SM (its fastest form), in microseconds; None
    when there is nothing to decide: no costs for this GPU, or one SM a chain is every SM."""
    step, costs = walk_step_us(program), pipeline_params()
    if step is None or not costs or restricted == sms:
        return None
    return step * min(predicted(chains, heads, sms, *measured_rho()[program]).values())


def _outlasts(walk_us: float, chunk_heads: int, cost: str, walks_beside: int) -> bool:
    """Whether `chunk_heads` (chunk, head) pairs of chunk-parallel work (pipeline_params()[cost] each), slowed
    beside `walks_beside` walks, take longer than `walk_us`: then the walk keeps one SM a chain."""
    costs = pipeline_params()
    return costs["chunk_stage_slowdown_beside_walk"][walks_beside] * chunk_heads * costs[cost] > walk_us


def _held_by_earlier_walks(program: str, chain_lengths: tuple, heads: int, sms: int, walks_beside: int,
                           first: tuple, pieced: int = -1) -> int:
    """The SMs that earlier groups' walks are predicted to hold still when the last group's chunk stage
    ends and its walks start (the replay: two walks at once, each planned on half the SMs): those walks
    get the others. A long earlier chain is then the critical path,
    and a last walk planned on every SM (split or quarter CTAs) only crowds it (docs/fit_rule.md,
    "The replay's last walks"). Times from pipeline_params: the chunk stage, slowed beside the walks
    after the first group, and each walk's predicted makespan on its SMs at the step it takes beside
    other CTAs."""
    step, costs = walk_step_us(program, alone=False), pipeline_params()
    if step is None or not costs or program not in measured_rho():
        return 0
    groups = grouping.plan_pipeline(chain_lengths, first)
    stage_us = heads * costs["chunk_stage_us_per_chunk_head"]
    slowdown = costs["chunk_stage_slowdown_beside_walk"][walks_beside]
    t, walks = 0.0, []
    for i, (a, b) in enumerate(groups[:-1]):
        t += sum(chain_lengths[a:b]) * stage_us * (1.0 if i == 0 else slowdown)
        held = pipelined_walk_sms(program, chain_lengths, heads, sms, i, walks_beside, first, pieced)
        span = min(predicted(chain_lengths[a:b], heads, held, *measured_rho()[program]).values())
        walks.append((t + step * span, held))
    a, b = groups[-1]
    start = t + sum(chain_lengths[a:b]) * stage_us * slowdown
    return min(sms, sum(held for end, held in walks if end > start))


@functools.lru_cache(maxsize=1024)
def rewalk_beside(chain_lengths: tuple, rewalk: tuple, heads: int, sms: int) -> int | None:
    """The SMs of the CP replay backward's second walk of the `rewalk` segments (backward.chunk_kda_bwd)
    when it runs beside kda_bwd_chunk over the other segments' chunks: one full CTA per chain, when
    that walk is predicted to end before kda_bwd_chunk over the others does (slowed by the SMs the
    walk holds); None: no such overlap pays (nothing else to run beside, more chains than SMs, a
    longer walk): the walk runs first, on every SM."""
    chains = heads * len(rewalk)
    step, costs = walk_step_us("kda_bwd_walk"), pipeline_params()
    others = sum(n for s, n in enumerate(chain_lengths) if s not in rewalk)
    if not rewalk or chains >= sms or step is None or not costs or others == 0:
        return None
    walk_us = step * max(chain_lengths[s] for s in rewalk)
    chunk_us = others * heads * costs["bwd_chunk_us_per_chunk_head"] * sms / (sms - chains)
    return chains if walk_us <= chunk_us else None


# Pieces of the CP summary walks (kda_aot.cp, batched summaries): a fragment of n chunks is walked as
# up to MAX_SUMMARY_PIECES chunk-aligned pieces, each from zero and with its own transfer, composed
# after in fp32 (S_out = M_p ... M_1 S_in + ...); at least MIN_SUMMARY_PIECE chunks a piece, so that the
# compositions (two [H, 128, 128] products per extra piece) stay small beside the walks.
MAX_SUMMARY_PIECES = 8
MIN_SUMMARY_PIECE = 32
# An extra piece costs its fragment two batched fp32 products and their launches, counted as walk
# steps (the GPU's table: pipeline.compose_steps_per_piece; docs/cp.md): more pieces must pay for themselves.
# A GPU without a table takes this default.
DEFAULT_COMPOSE_STEPS_PER_PIECE = 3.0


def compose_steps_per_piece() -> float:
    return float(_table(params_file()).get("pipeline", {}).get("compose_steps_per_piece",
                                                              DEFAULT_COMPOSE_STEPS_PER_PIECE))


@functools.lru_cache(maxsize=1024)
def summary_pieces(chain_lengths: tuple, heads: int, sms: int) -> tuple:
    """Pieces per fragment for one batched summary launch over fragments of `chain_lengths` chunks:
    the uniform piece length (the longest fragment cut in p = 1 .. MAX_SUMMARY_PIECES) whose launch
    (every piece x head a chain, one CTA per SM, in launch order) plus the compositions has the
    shortest predicted time, in walk steps; ties keep fewer pieces. E.g. one fragment of 1,953
    chunks at 32 heads on 132 SMs: 4 pieces (128 chains of <= 489 steps; 5 would make 160 chains,
    two waves); eight of 1,000 chunks: 1 (256 chains keep every SM busy already)."""
    lengths = [int(n) for n in chain_lengths]
    if not lengths or max(lengths) <= MIN_SUMMARY_PIECE:
        return tuple(1 for _ in lengths)
    best, best_span, compose = None, None, compose_steps_per_piece()
    for p in range(1, MAX_SUMMARY_PIECES + 1):
        piece = max(MIN_SUMMARY_PIECE, -(-max(lengths) // p))
        counts = tuple(max(1, -(-n // piece)) for n in lengths)
        chains = [float(len_) for n, c in zip(lengths, counts) for len_ in grouping.piece_lengths(n, c)]
        span = (makespan(launch_order(chains, heads), sms)
                + compose * (sum(counts) - len(lengths)))
        if best_span is None or span < best_span:
            best, best_span = counts, span
    return best


def cache_clear():
    """Forget every decision derived from a fit table (a test or a tool that changes PARAMS_FILE or its
    contents); the current GPU's name stays."""
    for cached in (_table, measured_rho, _decide, pipelined_walk_sms, rewalk_beside, summary_pieces):
        cached.cache_clear()
