"""How the pipelined forward cuts a pack into segment groups and pieces (docs/forward.md, "The pipeline"): which
segments each chunk-stage launch covers and in what order (plan_pipeline), which group's segment runs in pieces
(last_group_pieces on one GPU, pieced_group under context parallelism) and how many of them lead. The launch
planner (plan.py) builds its nodes from these; the fit rule (fit.py) prices the walks over them."""
from __future__ import annotations

from .. import options


def runs_of(forms: list) -> tuple:
    """((form, first segment, end segment), ...): maximal runs of consecutive segments of one form."""
    runs = []
    for s, form in enumerate(forms):
        if runs and runs[-1][0] == form:
            runs[-1][2] = s + 1
        else:
            runs.append([form, s, s + 1])
    return tuple(tuple(r) for r in runs)


PIPELINE_GROUPS = 4  # chunk-stage launches of a pipelined forward (each followed by its walk)


def plan_pipeline(chain_lengths, first: tuple = ()) -> tuple:
    """Segment groups ((first, end), ...) of a pipelined forward, in launch order. The chunk stage
    runs a group at a time and each group's walk starts, on a stream of its own, as soon as its
    chunks are done, beside the chunk stage of the groups after it: the longest walks go first so
    that they hide under the rest of the chunk stage. Up to PIPELINE_GROUPS segments: one group
    each; more: PIPELINE_GROUPS contiguous runs of about equal chunk totals. One group: no pipeline.
    first: segments that go before everything, each a group of its own, in their order (context
    parallelism: the fragments whose exit state another rank waits for); the others' groups are
    the runs above with those segments taken out."""
    lengths = [int(n) for n in chain_lengths]
    n = len(lengths)
    if n < 2:
        return ((0, n),)
    if n <= PIPELINE_GROUPS:
        groups = [(s, s + 1) for s in range(n)]
    else:
        total, groups, start, acc = sum(lengths), [], 0, 0
        for s, length in enumerate(lengths[:-1]):
            acc += length
            if len(groups) < PIPELINE_GROUPS - 1 and acc * PIPELINE_GROUPS >= total * (len(groups) + 1):
                groups.append((start, s + 1))
                start = s + 1
        groups.append((start, n))
    ahead = [int(s) for s in first]
    if ahead:  # each group's runs of segments that are not ahead (runs_of counts from the group's start)
        groups = [(a + ra, a + rb) for a, b in groups
                  for inside, ra, rb in runs_of([s not in ahead for s in range(a, b)]) if inside]
    ordered = tuple(sorted(groups, key=lambda g: -max(lengths[g[0]:g[1]])))
    return tuple((s, s + 1) for s in ahead) + ordered


# The forward cuts the last group's segment (when it is one) into this many pieces of chunks: its
# walk then starts once the first piece's chunk stage is done instead of the whole group's, and the
# walk that runs alone at the end shrinks to about the last piece's chunk stage plus what is left of
# the walk: unpieced, that walk runs alone on a few SMs after the whole group's chunk stage
# (docs/forward.md, "The pipeline").
LAST_GROUP_PIECES = 4
MIN_PIECE_CHUNKS = 8


def last_group_pieces(chain_lengths, first: tuple = ()) -> list | None:
    """The chunk bounds [c_0, .., c_P] of the pieces the pipelined forward cuts its last group's
    segment into, or None (the last group holds several segments, or a segment too short to
    cut: pieces of at least MIN_PIECE_CHUNKS chunks)."""
    lengths = [int(n) for n in chain_lengths]
    groups = plan_pipeline(lengths, first)
    a, b = groups[-1]
    if len(groups) < 2 or b - a != 1:
        return None
    n = lengths[a]
    pieces = min(LAST_GROUP_PIECES, n // MIN_PIECE_CHUNKS)
    if pieces < 2:
        return None
    first = sum(lengths[:a])
    return [first + (n * p) // pieces for p in range(pieces + 1)]


def pieced_group(chain_lengths, first: tuple = (), deferred: tuple = (), cp: bool = False):
    """(group, chunk bounds) of the group the pipelined forward cuts in pieces (plan_pipeline(chain_lengths,
    first)'s index), or None. One GPU: the last group (last_group_pieces). Context parallelism (cp): the
    one-segment group of the longest chain that is not deferred - the rank's critical walk there, as a
    CP rank holds half the tokens but whole long documents, whose walk would otherwise wait for their
    whole chunk stage (docs/cp.md); its first piece launches ahead of everything (plan._launch_order). A
    sent chain (first) too, also when it is the rank's only one, so that the other rank does not wait
    at the exchange for that chain's whole chunk stage (the CP replay, which sends nothing, then pieces
    a rank's only chain too) - with Options.cp_piece_senders (off: docs/cp.md says what decides it)."""
    lengths = [int(n) for n in chain_lengths]
    groups = plan_pipeline(lengths, first)
    if not cp:
        bounds = last_group_pieces(lengths, first)
        return None if bounds is None else (len(groups) - 1, bounds)
    senders_too = options.current().cp_piece_senders
    candidates = [i for i, (a, b) in enumerate(groups) if b - a == 1 and (senders_too or a not in first)
                  and a not in deferred and lengths[a] >= 2 * MIN_PIECE_CHUNKS]
    if (len(groups) < 2 and not senders_too) or not candidates:
        return None
    i = max(candidates, key=lambda g: (lengths[groups[g][0]], -g))
    a = groups[i][0]
    n, pieces = lengths[a], cp_pieces(lengths[a])
    start = sum(lengths[:a])
    return i, [start + (n * p) // pieces for p in range(pieces + 1)]


def cp_pieces(n: int) -> int:
    """How many pieces pieced_group cuts a CP chain of n chunks into."""
    return min(CP_PIECES, n // MIN_PIECE_CHUNKS)


def first_piece_chunks(n: int) -> int:
    """The chunks of the first piece pieced_group cuts a CP chain of n chunks into."""
    return n // cp_pieces(n)


# The CP forward cuts the rank's critical chain into this many pieces, and launches the senders'
# chunk stage after the first half of them: the walk trails the chunk stage by (walk - chunk stage)
# per piece, so by then it has slack for the senders' chunk stage instead of stalling for it (as it
# does right after the first piece); the other rank still gets the senders' exit states before its
# own walks are done (docs/cp.md). Smaller pieces also start the walk sooner (the first piece's chunk
# stage runs alone).
CP_PIECES = 8


def lead_pieces(pieces: int) -> int:
    """How many of the CP pieced group's pieces launch before the senders' groups (plan._launch_order)."""
    return max(1, pieces // 2)


def piece_lengths(n: int, pieces: int) -> list:
    """n chunks cut into `pieces` runs as equal as they come, longer ones first."""
    base, extra = divmod(n, pieces)
    return [base + (1 if i < extra else 0) for i in range(pieces)]
