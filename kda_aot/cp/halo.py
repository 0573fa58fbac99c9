"""The conv halo under context parallelism: the 3 tokens before each local fragment.

The width-4 causal conv of a fragment that does not start its document reads the 3 tokens
before it, which live on other ranks (possibly several: a predecessor fragment may be shorter
than 3 tokens). Any token a halo needs is among the last 3 tokens of the fragment that holds
it (it lies within 3 tokens before a later fragment's start, hence within 3 tokens of its own
fragment's end), so every rank publishes the last min(3, length) tokens of each of its
fragments that is followed by another fragment of its document ("tails"), one all_gather, and
every rank assembles its halos from the table. The backward sends each halo row's gradient
back the same way (one all_gather of the halo gradients) and each owner adds what lands on its
tail tokens to their gradient.

conv1d_silu_cp convolves several tensors (q, k and v of a layer) with one all_gather each way, and
its backward adds the returned halo gradients into the conv's own input gradient in place, on the
few tail rows (fp32, in table order: deterministic): a halo as its own autograd node costs a
full-size zero fill and a full-size sum per tensor (docs/cp.md).
"""
from __future__ import annotations

import itertools
from typing import List, Optional, Sequence, Tuple

import torch

from .._runtime.tensor import host_table_to
from .._runtime.packing import PLANNED_FROM_HOST
from ..reference import CONV_WIDTH
from . import keys
from .exchange import exchange_flat, payload_layout, post_agreement, resolve_group
from .plan import CPPlan, Fragment

__all__ = ["conv_halo", "conv1d_silu_cp", "ReferenceConv", "CudaConv", "conv_facts"]

HALO = CONV_WIDTH - 1


def _sources(plan: CPPlan, f: Fragment) -> List[Tuple[int, Fragment, int]]:
    """For local fragment f: (halo row j, source fragment, token offset in the source) for
    each of the HALO positions before f that lie inside its document. Walks back over as many
    fragments (and ranks) as needed; positions before the document start are left out (0)."""
    out = []
    if not f.needs_state:
        return out
    doc_start = plan.cu_seqlens[f.doc]
    for j in range(HALO):
        p = f.start - HALO + j
        if p < doc_start:
            continue
        e = plan.previous(f)
        while e.start > p:
            e = plan.previous(e)
        out.append((j, e, p - e.start))
    return out


def _tail_slot(e: Fragment, offset: int) -> int:
    """Where token `offset` of fragment e sits in e's published tail (right-aligned)."""
    return HALO - (e.length - offset)


def _publishes_tail(f: Fragment) -> int:
    """Rows (of the summed widths) fragment f publishes in the forward exchange: its tail."""
    return 0 if f.is_last else HALO


def _returns_halo(f: Fragment) -> int:
    """Rows fragment f publishes in the backward exchange: its halo's gradient."""
    return HALO if f.needs_state else 0


class _HaloTables:
    """The device index tables of a plan's halo exchanges, built once per (plan, device) (CPPlan.memo):
    a step launches a fixed handful of gathers and builds nothing on the host. Rows are counted in
    units of the summed widths of the exchanged tensors (every payload is HALO such rows)."""

    def __init__(self, plan: CPPlan, device: torch.device):
        table = lambda ix: host_table_to(torch.tensor(ix, dtype=torch.int64), device)  # noqa: E731
        local = plan.local_fragments
        self.n_local = len(local)
        # forward: this rank's tails (local token rows, right-aligned; slots before a fragment shorter
        # than HALO hold NaN: never read), and each halo row's row in the gathered tails
        tails, empty = [], []
        for f in local:
            for s in range(_publishes_tail(f)):
                t = f.length - HALO + s
                if t < 0:
                    empty.append(len(tails))
                tails.append(f.local_start + max(t, 0))
        width, offsets, mine = payload_layout(plan, _publishes_tail)
        self.tail_layout = (width, mine)  # the forward exchange's width and this rank's total, in rows
        self.zero_row = plan.world_size * width  # one zero row appended to the gathered rows
        src = [self.zero_row] * (len(local) * HALO)  # halo rows before a document's start: zeros
        for f in local:
            for j, e, off in _sources(plan, f):
                src[f.segment * HALO + j] = offsets[e.index] + _tail_slot(e, off)
        self.tails = table(tails) if tails else None
        self.tail_empty = table(empty) if empty else None
        self.halo_src = table(src)
        # backward: the local segments whose halo gradient this rank returns, and the local token
        # rows the returned gradients land on, each row's contributions summed in table order (every
        # rank's halo rows in global order: a fixed summation order, deterministic)
        senders = [f.segment for f in local if f.needs_state]
        self.senders = table(senders) if senders else None
        width, offsets, mine = payload_layout(plan, _returns_halo)
        self.grad_layout = (width, mine)  # the backward exchange's, in rows
        mine = {f.index for f in local}
        contributions = [(e.local_start + off, offsets[g.index] + j)
                         for g in plan.fragments for j, e, off in _sources(plan, g) if e.index in mine]
        rows, groups = [], []
        for row, src_row in sorted(contributions, key=lambda c: c[0]):  # stable: table order kept
            if rows and rows[-1] == row:
                groups[-1].append(src_row)
            else:
                rows.append(row)
                groups.append([src_row])
        self.grad_rows = table(rows) if rows else None
        self.grad_first = table([g[0] for g in groups]) if rows else None
        # a token in several halos (fragments shorter than HALO): (groups that have a k-th, its row)
        self.grad_more = [(table([r for r, g in enumerate(groups) if len(g) > k]),
                           table([g[k] for g in groups if len(g) > k]))
                          for k in range(1, max((len(g) for g in groups), default=0))]

    @staticmethod
    def of(plan: CPPlan, device: torch.device) -> "_HaloTables":
        return plan.memo(("halo tables", str(device)), lambda: _HaloTables(plan, device))


def _published_tails(plan: CPPlan, xs: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """LOCAL: this rank's tails of every x_i [rows, sum D_i] (detached: their gradient comes back
    through the backward exchange), or None when it publishes none. Safe to queue before the ranks'
    agreement is read once this rank's own arguments checked out (conv_facts)."""
    tables = _HaloTables.of(plan, xs[0].device)
    if tables.tails is None:
        return None
    packed = torch.cat([x.detach()[0].index_select(0, tables.tails) for x in xs], dim=-1)
    if tables.tail_empty is not None:
        packed.index_fill_(0, tables.tail_empty, float("nan"))
    return packed


def _halos(plan: CPPlan, group, xs: Sequence[torch.Tensor], tails: Optional[torch.Tensor]) -> List[torch.Tensor]:
    """Collective: the halos [n_local, HALO, D_i] (x_i's dtype) of every x_i, one all_gather of the
    tails (_published_tails). A fixed handful of launches whatever the number of fragments."""
    widths = [x.shape[-1] for x in xs]
    total = sum(widths)
    tables = _HaloTables.of(plan, xs[0].device)
    width, mine = tables.tail_layout
    gathered = exchange_flat(plan, group, width * total, mine * total, tails, xs[0].dtype, like=xs[0])
    if gathered is None:  # nobody publishes: no halo reads anything
        return [x.new_zeros(tables.n_local, HALO, d) for x, d in zip(xs, widths)]
    rows = torch.nn.functional.pad(gathered.view(-1, total), (0, 0, 0, 1))  # + the zero row
    firsts = [0, *itertools.accumulate(widths)]
    return [rows[:, a:b].index_select(0, tables.halo_src).view(tables.n_local, HALO, b - a)
            for a, b in zip(firsts[:-1], firsts[1:])]


def _returned_halo_grads(plan: CPPlan, group, dhalos: Sequence[torch.Tensor], widths, like):
    """Collective: the gradients of the halo rows every rank read from this rank's tail tokens, one
    all_gather. Returns (local token rows [R] int64 on like's device, their gradient [R, sum widths]
    in dhalos' dtype, each row's contributions summed in table order: deterministic) or None."""
    total = sum(widths)
    tables = _HaloTables.of(plan, like.device)
    packed = None
    if tables.senders is not None:
        dhalo = dhalos[0] if len(dhalos) == 1 else torch.cat(list(dhalos), dim=-1)
        packed = dhalo.index_select(0, tables.senders)
    width, mine = tables.grad_layout
    gathered = exchange_flat(plan, group, width * total, mine * total, packed, dhalos[0].dtype, like=like)
    if tables.grad_rows is None:
        return None
    rows = gathered.view(-1, total)
    summed = rows.index_select(0, tables.grad_first)
    for has, src in tables.grad_more:
        summed.index_copy_(0, has, summed.index_select(0, has) + rows.index_select(0, src))
    return tables.grad_rows, summed


class ReferenceConv:
    """kda_aot.reference's conv in `dtype` (None: x's dtype); its backward by autograd."""

    def __init__(self, dtype: Optional[torch.dtype] = None):
        self.dtype = dtype

    @property
    def spec(self) -> str:
        """What conv_of rebuilds this conv from (the CP custom ops take it as a string)."""
        return "reference" if self.dtype is None else f"reference:{str(self.dtype).replace('torch.', '')}"

    def out_dtype(self, x: torch.Tensor) -> torch.dtype:
        return self.dtype or x.dtype

    def forward(self, x, w, b, cu_seqlens, halo):
        from ..reference import conv1d_silu
        return conv1d_silu(x, w, b, cu_seqlens=cu_seqlens, halo=halo, dtype=self.out_dtype(x))

    def backward(self, x, w, b, cu_seqlens, halo, dy):
        """(dx, dw, db or None, dhalo) in the dtypes of x, w, b and halo (reference.conv1d_silu_bwd)."""
        from ..reference import conv1d_silu_bwd
        dx, dw, db, dhalo = conv1d_silu_bwd(x, w, b, dy, cu_seqlens=cu_seqlens, halo=halo, dtype=self.out_dtype(x))
        return dx.to(x.dtype), dw.to(w.dtype), None if db is None else db.to(b.dtype), dhalo.to(halo.dtype)


class CudaConv:
    """The kernels of kda_aot.ops.conv (bf16 x and y, fp32 taps, fp32 weight and halo gradients); l2norm:
    the form with the per-head L2 norm fused (causal_conv1d_silu(l2norm=True))."""

    def __init__(self, l2norm: bool = False):
        self.l2norm = l2norm

    @property
    def spec(self) -> str:
        return "cuda:l2norm" if self.l2norm else "cuda"

    def out_dtype(self, x: torch.Tensor) -> torch.dtype:
        return x.dtype

    def forward(self, x, w, b, cu_seqlens, halo):
        from ..ops.conv import _f32, checked_boundaries, conv1d_silu_forward, conv_form
        cu = checked_boundaries(x, w, b, halo, _host_bounds(cu_seqlens))
        return conv1d_silu_forward(x, _f32(w), _f32(b), cu, halo, form=conv_form(x, self.l2norm))

    def backward(self, x, w, b, cu_seqlens, halo, dy):
        from ..ops.conv import _f32, checked_boundaries, conv1d_silu_backward, conv_form
        cu = checked_boundaries(x, w, b, halo, _host_bounds(cu_seqlens))
        dx, dw, db, dhalo = conv1d_silu_backward(x, _f32(w), _f32(b), cu, dy.contiguous(), halo, need_dhalo=True,
                                                 form=conv_form(x, self.l2norm))
        return dx, dw.to(w.dtype), None if db is None else db.to(b.dtype), dhalo


def _host_bounds(cu_seqlens) -> torch.Tensor:
    # the plan's boundaries stay on the host (kda_aot._runtime.packing caches their device copy: no sync)
    return cu_seqlens if isinstance(cu_seqlens, torch.Tensor) else torch.tensor(cu_seqlens, dtype=torch.int32)


def conv_of(spec: str):
    """A conv op object from its spec (ReferenceConv.spec, CudaConv.spec)."""
    kind, _, arg = spec.partition(":")
    if kind == "reference":
        return ReferenceConv(getattr(torch, arg) if arg else None)
    if kind == "cuda":
        return CudaConv(l2norm=arg == "l2norm")
    raise ValueError(f"unknown conv {spec!r}: expected 'reference', 'cuda' or a conv object with a spec")


class _ConvContext:
    """What the CP conv's forward leaves for its backward (kda_aot.cp.keys holds it under the handle), its
    tensors detached."""

    def __init__(self, plan, group, convs, xs, ws, bs, halos):
        self.plan, self.group, self.convs = plan, group, convs
        self.xs, self.ws, self.bs, self.halos = keys.detached((xs, ws, bs, halos))


def _kda_agreement_facts(xs, kda_g, kda_beta, kda_h0, plan, scale, backward, backend):
    """The KDA call's facts and this rank's problem, for PackedKDA's one agreement check (its q, k, v are
    the conv's outputs: the conv's inputs seen in heads)."""
    from .ops import kda_facts
    T, H = kda_g.shape[1], kda_g.shape[2]
    heads = [x.view(1, T, H, x.shape[-1] // H) if x.shape[1] == T and x.shape[-1] % H == 0 else x for x in xs]
    _, facts, problem, _ = kda_facts(*heads, kda_g, kda_beta, kda_h0, plan, scale, backward, backend)
    return facts, problem


# The biases travel as tensors (torch.library's autograd takes no None inside a tensor list): a missing one
# as an empty placeholder, has_bias saying which.

@torch.library.custom_op("kda_aot::conv1d_silu_cp_fwd", mutates_args=(), tags=PLANNED_FROM_HOST)
def conv1d_silu_cp_fwd_op(xs: List[torch.Tensor], weights: List[torch.Tensor], biases: List[torch.Tensor],
                          has_bias: List[bool], plan: torch.Tensor, group: str, convs: str, op: str,
                          kda_g: Optional[torch.Tensor], kda_beta: Optional[torch.Tensor],
                          kda_h0: Optional[torch.Tensor], kda_scale: float, kda_backward: str,
                          kda_backend: str) -> List[torch.Tensor]:
    """Collective: the agreement check (with a KDA call's facts when kda_g is given: PackedKDA's one check),
    the halos in one exchange, the convs (convs: their specs, comma-separated). Returns [y_1, ..., y_n, the
    context handle]."""
    plan_obj, group_obj = keys.lookup(plan), keys.group_of(group)
    conv_objs = [conv_of(c) for c in convs.split(",")]
    bs = [b if has else None for b, has in zip(biases, has_bias)]
    with torch.autocast(xs[0].device.type, enabled=False):
        facts, problem = conv_facts(xs, plan_obj)
        if kda_g is not None:
            kda, kda_problem = _kda_agreement_facts(xs, kda_g, kda_beta, kda_h0, plan_obj, kda_scale, kda_backward,
                                                    kda_backend)
            facts, problem = {**facts, **kda}, problem or kda_problem
        agreement = post_agreement(op, plan_obj, group_obj, facts, problem, xs[0])
        tails = _published_tails(plan_obj, xs) if agreement.locally_ok else None
        agreement.wait()
        halos = _halos(plan_obj, group_obj, xs, tails)
        if plan_obj.local_fragments:
            ys = [conv.forward(x, w, b, plan_obj.local_cu_seqlens, h).contiguous()
                  for conv, x, w, b, h in zip(conv_objs, xs, weights, bs, halos)]
        else:  # no token here: empty outputs, and the backward still joins the collective
            ys = [x.new_zeros(1, 0, x.shape[-1], dtype=conv.out_dtype(x)) for conv, x in zip(conv_objs, xs)]
    return [*ys, keys.stash(_ConvContext(plan_obj, group_obj, conv_objs, xs, weights, bs, halos))]


@conv1d_silu_cp_fwd_op.register_fake
def _(xs, weights, biases, has_bias, plan, group, convs, op, kda_g, kda_beta, kda_h0, kda_scale, kda_backward,
      kda_backend):
    return [*(x.new_empty(x.shape, dtype=conv_of(c).out_dtype(x)) for x, c in zip(xs, convs.split(","))),
            torch.empty(1, dtype=torch.int64, device="cpu")]


@torch.library.custom_op("kda_aot::conv1d_silu_cp_bwd", mutates_args=(), tags=PLANNED_FROM_HOST)
def conv1d_silu_cp_bwd_op(handle: torch.Tensor, xs: List[torch.Tensor], weights: List[torch.Tensor],
                          biases: List[torch.Tensor], dys: List[torch.Tensor]) -> List[torch.Tensor]:
    """Collective: [dx_1..n, dweight_1..n, dbias_1..n (empty where there is no bias)] of the forward behind
    `handle`; the halo gradients return to their owners in one exchange."""
    ctx = keys.context_of(handle)
    plan, group = ctx.plan, ctx.group
    with torch.autocast(xs[0].device.type, enabled=False):
        if plan.local_fragments:
            parts = [conv.backward(x, w, b, plan.local_cu_seqlens, h, dy)
                     for conv, x, w, b, h, dy in zip(ctx.convs, ctx.xs, ctx.ws, ctx.bs, ctx.halos, dys)]
        else:
            parts = [(torch.zeros_like(x), torch.zeros_like(w), None if b is None else torch.zeros_like(b), h)
                     for x, w, b, h in zip(ctx.xs, ctx.ws, ctx.bs, ctx.halos)]
        # the halo gradients travel in fp32 at least and are added to the dx rows once, then rounded
        dhalos = [p[3].to(torch.promote_types(p[3].dtype, torch.float32)) for p in parts]
        back = _returned_halo_grads(plan, group, dhalos, [x.shape[-1] for x in ctx.xs], like=ctx.xs[0])
        dxs = [p[0].contiguous() for p in parts]
        if back is not None:
            rows, grads = back
            first = 0
            for dx in dxs:
                d = dx.shape[-1]
                add = grads[:, first:first + d]
                dx[0].index_copy_(0, rows, (dx[0].index_select(0, rows).to(add.dtype) + add).to(dx.dtype))
                first += d
    return [*dxs, *(p[1].contiguous() for p in parts),
            *(b.new_empty((0,)) if p[2] is None else p[2].contiguous() for b, p in zip(biases, parts))]


@conv1d_silu_cp_bwd_op.register_fake
def _(handle, xs, weights, biases, dys):
    return [*(x.new_empty(x.shape) for x in xs), *(w.new_empty(w.shape) for w in weights),
            *(b.new_empty(b.shape) for b in biases)]


def _conv_setup_context(ctx, inputs, output):
    xs, weights, biases, has_bias = inputs[:4]
    ctx.n, ctx.has_bias = len(xs), list(has_bias)
    ctx.save_for_backward(output[-1], *xs, *weights, *biases)
    ctx.mark_non_differentiable(output[-1])
    keys.adopt(ctx, output[-1])


def _conv_backward(ctx, grads):
    handle, *saved = ctx.saved_tensors
    n = ctx.n
    xs, ws, bs = saved[:n], saved[n:2 * n], saved[2 * n:]
    dys = [torch.zeros_like(x) if dy is None else dy for x, dy in zip(xs, grads[:n])]
    out = conv1d_silu_cp_bwd_op(keys.handle_for(ctx, handle), list(xs), list(ws), list(bs), dys)
    dbs = [db if has else None for db, has in zip(out[2 * n:], ctx.has_bias)]
    return (list(out[:n]), list(out[n:2 * n]), dbs) + (None,) * 11


conv1d_silu_cp_fwd_op.register_autograd(_conv_backward, setup_context=_conv_setup_context)


def _conv_cp(xs, weights, biases, plan: CPPlan, group, convs, op: str, kda=None):
    """The CP conv through its op: the ys. kda: (g, beta, initial_state, scale, backward, backend object) of a
    KDA call whose facts join this call's agreement check (PackedKDA)."""
    from .backends import backend_name
    g, beta, h0, scale, mode, backend = kda if kda is not None else (None, None, None, 0.0, "replay", None)
    placeholders = [b if b is not None else x.new_empty((0,)) for x, b in zip(xs, biases)]
    out = conv1d_silu_cp_fwd_op(list(xs), list(weights), placeholders, [b is not None for b in biases],
                                plan.key_tensor, group.group_name, ",".join(c.spec for c in convs), op, g, beta,
                                h0, float(scale), mode, "" if backend is None else backend_name(backend))
    return out[:-1]


def _check_tensors(xs) -> None:
    """Type errors raise here, before any collective, on every rank alike (the rest is conv_facts, in the op)."""
    for x in xs:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")


def conv_facts(xs: Sequence[torch.Tensor], plan: CPPlan) -> Tuple[dict, Optional[str]]:
    """(facts every rank must agree on, this rank's problem or None) of a CP conv of xs."""
    problem = None
    for i, x in enumerate(xs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[0] != 1 or x.shape[1] != plan.num_local_tokens:
            problem = problem or (f"x must be [1, {plan.num_local_tokens}, D] for rank {plan.rank}, "
                                  f"got {list(x.shape)}")
        elif x.dtype != xs[0].dtype or x.device != xs[0].device:
            problem = problem or f"the conv inputs differ in dtype or device ({x.dtype} on {x.device})"
    facts = {"conv D": tuple(x.shape[-1] if x.dim() else None for x in xs), "conv dtype": xs[0].dtype}
    return facts, problem


def conv_halo(x_local: torch.Tensor, plan: CPPlan, group=None) -> torch.Tensor:
    """Collective, differentiable: the conv halo of this rank's local fragments.

    x_local: [1, T_local, D] (tokens in plan.token_map order). Returns halo [n_local, 3, D]
    (x's dtype), row i for local segment i: the 3 tokens before the fragment, zero before its
    document's start (a fragment that starts its document gets zeros). Then
        reference.conv1d_silu(x_local, w, b, cu_seqlens=plan.local_cu_seqlens, halo=halo)
    equals the single-device conv on this rank's tokens, and the halo's gradient flows back
    to the ranks that own those tokens in the backward, which is collective as well: the halo
    must reach the loss on EVERY rank, including a rank that holds no token (whose halo is
    [0, 3, D]). conv1d_silu_cp is this and the conv in one node (what the module uses).
    """
    _check_tensors([x_local])
    group, _, _ = resolve_group(group)
    return conv_halo_cp_fwd_op(x_local, plan.key_tensor, group.group_name)[0]


@torch.library.custom_op("kda_aot::conv_halo_cp_fwd", mutates_args=(), tags=PLANNED_FROM_HOST)
def conv_halo_cp_fwd_op(x: torch.Tensor, plan: torch.Tensor, group: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Collective: the agreement check, then (the halo [n_local, 3, D] in one exchange, the context handle)."""
    plan_obj, group_obj = keys.lookup(plan), keys.group_of(group)
    facts, problem = conv_facts([x], plan_obj)
    agreement = post_agreement("conv_halo", plan_obj, group_obj, facts, problem, x)
    tails = _published_tails(plan_obj, [x]) if agreement.locally_ok else None
    agreement.wait()
    halo = _halos(plan_obj, group_obj, [x], tails)[0].contiguous()
    return halo, keys.stash((plan_obj, group_obj))


@conv_halo_cp_fwd_op.register_fake
def _(x, plan, group):
    # the row count depends on the plan: a size the fake cannot know
    rows = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty((rows, HALO, x.shape[-1])), torch.empty(1, dtype=torch.int64, device="cpu")


@torch.library.custom_op("kda_aot::conv_halo_cp_bwd", mutates_args=(), tags=PLANNED_FROM_HOST)
def conv_halo_cp_bwd_op(handle: torch.Tensor, dhalo: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Collective: dx (x's shape) of the halo: each halo row's gradient back on its owner's tail token."""
    plan, group = keys.context_of(handle)
    dx = dhalo.new_zeros(x.shape)
    back = _returned_halo_grads(plan, group, [dhalo.contiguous()], [x.shape[-1]], like=dhalo)
    if back is not None:
        rows, grads = back
        dx[0].index_copy_(0, rows, grads)
    return dx


@conv_halo_cp_bwd_op.register_fake
def _(handle, dhalo, x):
    return dhalo.new_empty(x.shape)


def _halo_setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1], inputs[0])
    ctx.mark_non_differentiable(output[1])
    keys.adopt(ctx, output[1])


def _halo_backward(ctx, dhalo, _):
    handle, x = ctx.saved_tensors
    return conv_halo_cp_bwd_op(keys.handle_for(ctx, handle), dhalo, x), None, None


conv_halo_cp_fwd_op.register_autograd(_halo_backward, setup_context=_halo_setup_context)


def conv1d_silu_cp(xs, weights, biases=None, *, plan: CPPlan, group=None, conv="auto"):
    """Collective, differentiable: the causal conv1d + SiLU of this rank's tokens under CP.

    xs: one [1, T_local, D] tensor or a list of them (same dtype and device; e.g. q, k and v),
    weights / biases: one per x ([D, 4], [D] or None). The halos of all of them travel in one
    all_gather, their gradients back in one more. conv: "auto" (kda_aot.registry.auto_backend), "reference" (kda_aot.reference in x's dtype), "cuda" (the kernels,
    bf16), a ReferenceConv or CudaConv, or a list of them, one per x (PackedKDA: CudaConv(l2norm=True)
    for q and k). Returns y (or the list of y's) [1, T_local, D]. A rank that holds no token returns
    empty results that must still reach the loss (the backward is collective). The ranks' agreement is
    checked first, its all_gather posted before the tails are gathered on the GPU and read after.
    """
    single = isinstance(xs, torch.Tensor)
    xs, weights, biases, convs = conv_arguments(xs, weights, biases, conv)
    _check_tensors(xs)
    if not isinstance(plan, CPPlan):
        raise TypeError(f"plan: expected a kda_aot.cp.CPPlan (see kda_aot.cp.make_plan), got {type(plan).__name__}")
    group, _, _ = resolve_group(group)
    ys = _conv_cp(xs, weights, biases, plan, group, convs, "conv1d_silu_cp")
    return ys[0] if single else list(ys)


def conv_arguments(xs, weights, biases, conv):
    """(xs, weights, biases, conv objects) as lists of one entry per x, checked."""
    single = isinstance(xs, torch.Tensor)
    xs = [xs] if single else list(xs)
    weights = [weights] if single else list(weights)
    biases = [biases] if single else list(biases if biases is not None else [None] * len(xs))
    if len(weights) != len(xs) or len(biases) != len(xs):
        raise ValueError(f"conv1d_silu_cp: {len(xs)} inputs but {len(weights)} weights and {len(biases)} biases")
    if isinstance(conv, str) and conv == "auto":
        from .._runtime.registry import auto_backend
        conv = auto_backend(xs[0])
    conv = conv_of(conv) if isinstance(conv, str) else conv
    convs = list(conv) if isinstance(conv, (list, tuple)) else [conv] * len(xs)
    if len(convs) != len(xs):
        raise ValueError(f"conv1d_silu_cp: {len(xs)} inputs but {len(convs)} conv ops")
    return xs, weights, biases, convs
