"""The KDA backward's launch sequences: the backward walk (chunk_kda_bwd_walk), kda_bwd_chunk and
kda_bwd_gate (chunk_kda_bwd), and the replay backward (replay_backward: the forward kernels again, their
walks beside the backward walk, kda_bwd_chunk a group at a time behind them, then kda_bwd_gate), a head group
at a time when memory is short. The chunk stage, the forward walk and the launch helpers are kda.py's (used
through the module, so that a test's stand-ins for them reach this file too)."""
from __future__ import annotations

import collections
import itertools

import torch

from . import execute, fit, grouping, kda
from .. import options
from ..reference.kda import sum_value_head_groups
from .._runtime import registry
from .._runtime.packing import CHUNK
from .._runtime.tensor import out_or
from .plan import replay_plan, replay_walk_sms, segment_runs


def _check_dout(dout, v):
    if not isinstance(dout, torch.Tensor):
        raise TypeError(f"dout: expected a torch.Tensor, got {type(dout).__name__}")
    if dout.shape != v.shape:
        raise ValueError(f"dout: expected shape {list(v.shape)} (as o), got {list(dout.shape)}")


def chunk_kda_bwd_walk(saved: dict, dout, dfinal_state=None, *, need_dinitial_state=True, need_dtape=True,
                       out=None, walk_form=None, sm_count=None, pool=None):
    """Backward state walk (kda_bwd_walk) over the intermediates of chunk_kda_fwd: returns
    (dtape [n_chunks, H, 128, 128] fp32 = gradient of the state at each chunk END, or None,
    d_initial_state [N, H, 128, 128] fp32 or None). need_dtape=False: the offset walk (context
    parallelism's entering-state gradients: no tape written; the binding refuses a call that asks
    for neither). `out` may hold preallocated tensors.
    walk_form: auto | full | split | quarter (default: Options.walk_form, auto = the fit
    rule). sm_count: the SMs the fit rule plans for (default: the device's); pool: as chunk_kda_walk's."""
    v = saved["v"]  # H below: the value heads
    _check_dout(dout, v)
    N, H, C = saved["seg_chunks"].numel() - 1, v.shape[2], saved["chunks"].shape[0]
    scale = saved["scale"]
    out = dict(out or {})
    f32 = dict(device=v.device, dtype=torch.float32)
    t = {name: saved[name] for name in ("chunks", "seg_chunks", "w", "qg", "kg", "aqk", "gamma")}
    t.update(dout=dout.contiguous(), dfinal_state=dfinal_state,
             dtape=out_or(out, "dtape", lambda: torch.empty(C, H, kda.HEAD_DIM, kda.HEAD_DIM, **f32)) if need_dtape else None,
             dinitial_state=(out_or(out, "dinitial_state", lambda: torch.empty(N, H, kda.HEAD_DIM, kda.HEAD_DIM, **f32))
                             if need_dinitial_state else None))
    kda._launch_walk("kda_bwd_walk", t, saved["chain_lengths"], H, scale, v.device, walk_form, sm_count, pool)
    return t["dtape"], t["dinitial_state"]


def chunk_kda_bwd_chunk(saved: dict, dout, dtape):
    """The plain-product half of the chunk-parallel backward (kda_bwd_chunk) over a forward run
    with save_tape=True and the backward walk's dtape: returns a dict of dv and the intermediates
    drk, dqg, daqk, daqk_lo (dAqk's bf16 rounding residue), dakk (bf16) and dkg, daqk_diag, dbeta_v, dgam_s
    (fp32) (see templates/common/kda.h)."""
    t = bwd_chunk_tensors(saved, dout, dtape)
    launch_bwd_chunk(t)
    return {name: t[name] for name in _BWD_CHUNK_OUTPUTS}


_BWD_CHUNK_OUTPUTS = ("dv", "drk", "dqg", "dkg", "daqk", "daqk_lo", "dakk", "daqk_diag", "dbeta_v", "dgam_s")


def bwd_chunk_tensors(saved: dict, dout, dtape) -> dict:
    """kda_bwd_chunk's inputs (from saved, dout, dtape) and its outputs, allocated (nothing launched)."""
    v = saved["v"]  # H below: the value heads
    if saved.get("tape") is None:
        raise ValueError("saved: run chunk_kda_fwd with save_tape=True (the backward reads the tape)")
    T, H, C = v.shape[1], v.shape[2], saved["chunks"].shape[0]
    f32 = dict(device=v.device, dtype=torch.float32)
    bf16 = dict(device=v.device, dtype=torch.bfloat16)
    t = {name: saved[name] for name in ("chunks", "seg_chunks", "w", "kg", "aqk", "gamma", "v", "u", "vnew",
                                         "akk_inv", "beta", "tape")}
    into = saved.get("into") or {}  # gradients' destinations given by the caller (_replay_tile)
    t.update(dout=dout.contiguous(), dtape=dtape, dv=out_or(into, "dv", lambda: torch.empty_like(v)),
             beta_kind=saved["beta_kind"],
             drk=torch.empty(1, T, H, kda.HEAD_DIM, **bf16), dqg=torch.empty(1, T, H, kda.HEAD_DIM, **bf16),
             dkg=torch.empty(1, T, H, kda.HEAD_DIM, **f32), daqk=torch.empty(1, T, H, CHUNK, **bf16),
             daqk_lo=torch.empty(1, T, H, CHUNK, **bf16),
             dakk=torch.empty(1, T, H, CHUNK, **bf16), daqk_diag=torch.empty(1, T, H, **f32),
             dbeta_v=torch.empty(1, T, H, **f32),
             dgam_s=torch.empty(C, H, kda.HEAD_DIM, **f32), scale=saved["scale"])
    return t


def launch_bwd_chunk(t: dict, first: int = 0, end: int | None = None):
    """kda_bwd_chunk over chunks [first, end) (all by default; per-chunk tensors narrowed as in
    _launch_chunk_stage: each chunk reads and writes its own rows)."""
    desc = {name: kda.describe(x, name) for name, x in kda._chunk_range(t, first, end).items()}
    lib = registry.library("kda_bwd_chunk", device=t["dout"].device)
    lib.launch(desc, t["scale"], kda.stream_of(t["dout"]), **kda.beta_launch_args(t["beta_kind"]))


def _gate_tensors(saved: dict, parts: dict, gate_form: str) -> dict:
    """kda_bwd_gate's inputs (from saved and kda_bwd_chunk's outputs) and its outputs, allocated (dq, dk one per
    value head: _gate_result sums each group)."""
    v = saved["v"]  # H below: the value heads
    T, H = v.shape[1], v.shape[2]
    t = {name: saved[name] for name in ("q", "k", "g", "beta", "chunks", "seg_chunks")}
    t.update({name: parts[name] for name in ("daqk", "daqk_lo", "dakk", "daqk_diag", "dqg", "dkg", "drk", "dbeta_v",
                                             "dgam_s")})
    into = saved.get("into") or {}  # gradients' destinations given by the caller (_replay_tile)
    t.update(dq=out_or(into, "dq", lambda: torch.empty_like(v)), dk=out_or(into, "dk", lambda: torch.empty_like(v)),
             dg=out_or(into, "dg", lambda: torch.empty_like(saved["g"])), scale=saved["scale"],
             beta_kind=saved["beta_kind"])
    gate = saved.get("gate")
    if gate is not None:  # each chunk's parts of the gate parameters' gradients, summed after in a fixed order
        C = saved["chunks"].shape[0]
        t.update(gate=gate, ddt_bias_part=torch.empty(C, H, kda.HEAD_DIM, device=v.device, dtype=torch.float32),
                 da_log_part=torch.empty(C, H, 2, device=v.device, dtype=torch.float32))
    if gate_form.startswith("split"):  # each channel half writes its dbeta partial; summed after, in a fixed order
        t["dbeta_part"] = torch.empty(2, T, H, device=v.device, dtype=torch.float32)
    else:
        t["dbeta"] = torch.empty(1, T, H, device=v.device, dtype=torch.float32)
    return t


def _launch_gate(t: dict, gate_form: str):
    desc = {name: kda.describe(x, name) for name, x in t.items() if isinstance(x, torch.Tensor)}
    kda.launch_gated(registry.library("kda_bwd_gate", gate_form, t["q"].device), desc, t["scale"], kda.stream_of(t["q"]),
                     t.get("gate"), t["beta_kind"])


def _gate_result(t: dict, dv, dh0) -> tuple:
    """(dq, dk, dv, dg, dbeta [1, T, H] fp32, d_initial_state) once kda_bwd_gate has run, and with the
    gate's activation (dg: the raw gate's) the per-chunk parts of dA_log [C, H, 2] and ddt_bias [C, H, 128]
    after them (gate_parameter_grads sums them). With
    beta's activation dbeta is the logits' gradient: the chain factor is taken here, where dbeta's parts are
    summed, the same for every gate form and both modes."""
    heads = t["q"].shape[2]
    dbeta = t["dbeta"] if "dbeta" in t else (t["dbeta_part"][0] + t["dbeta_part"][1]) + t["dbeta_v"][0]
    if t["beta_kind"] != kda.BETA_PLAIN:
        dbeta = kda.beta_logits_grad(dbeta, t["beta"], t["beta_kind"])
    dq, dk = sum_value_head_groups(t["dq"], heads), sum_value_head_groups(t["dk"], heads)
    grads = (dq, dk, dv, t["dg"], dbeta.view(dv.shape[:3]), dh0)
    if t.get("gate") is None:
        return grads
    return grads + (t["da_log_part"], t["ddt_bias_part"])


def gate_parameter_grads(da_log_part: torch.Tensor, ddt_bias_part: torch.Tensor) -> tuple:
    """dA_log [H] and ddt_bias [H, 128] from kda_bwd_gate's per-chunk parts of all H heads, one reduction
    each: the saved backward and the replay (also a head group at a time) reduce the same shapes, so their
    bits agree (a reduction's order may depend on its shape)."""
    return da_log_part.sum(dim=(0, 2)), ddt_bias_part.sum(dim=0)


def chunk_kda_bwd(saved: dict, dout, dfinal_state=None, *, release=False, gate_form=None, walk=None, rewalk=(),
                  parts=None):
    """Every input gradient from a forward run with save_tape=True: the backward walk
    (kda_bwd_walk), the plain products (kda_bwd_chunk) and the gated half (kda_bwd_gate).
    Returns (dq bf16, dk bf16, dv bf16, dg fp32, dbeta fp32, d_initial_state fp32); with the gate's
    activation (saved["gate"]) dg is the raw gate's, in its dtype, and the per-chunk parts of dA_log and
    ddt_bias follow (gate_parameter_grads sums them).
    release: drop each saved intermediate from `saved` once no later stage reads it, so the gated
    half's outputs reuse the tape's memory (the autograd path; `saved` is spent afterwards).
    gate_form: one of GATE_FORMS (default: Options.gate_form, else the shipped split_staged).
    walk: [dtape, d_initial_state] when the backward walk has run already (the replay runs it beside
    the forward walk); emptied here, so that dtape is freed once kda_bwd_chunk has read it (dtape None with
    parts).
    rewalk (with walk; context parallelism): segments whose walk ran from a stand-in exit-state
    gradient and runs again here from dfinal_state's rows, into walk's rows - beside kda_bwd_chunk
    over the other segments' chunks when fit.rewalk_beside says it hides there. Bitwise the same as
    walking them first.
    parts (with walk): kda_bwd_chunk's outputs when it has been launched already (the replay's plan launches it
    a group at a time, behind the walks)."""
    gate_form = kda._pick_form("gate_form", gate_form, kda.GATE_FORMS)
    if parts is not None and (walk is None or rewalk):
        raise ValueError("parts: kda_bwd_chunk ran behind the walks: give their walk, and no rewalk")
    if walk is not None:
        dtape, dh0 = walk
        walk.clear()
    else:
        dtape, dh0 = chunk_kda_bwd_walk(saved, dout, dfinal_state)
    if release:
        for name in ("qg", "o", "final_state", "aqk_diag_lo"):  # (the walk's output stage alone reads the last)
            saved.pop(name, None)
    if parts is None:  # else launched by the replay's plan
        parts = (_bwd_chunk_rewalk(saved, dout, dfinal_state, dtape, dh0, sorted(rewalk)) if rewalk
                 else chunk_kda_bwd_chunk(saved, dout, dtape))
    del dtape
    if release:
        for name in ("w", "u", "kg", "aqk", "vnew", "akk_inv", "tape", "gamma"):
            saved.pop(name, None)
    t = _gate_tensors(saved, parts, gate_form)
    _launch_gate(t, gate_form)
    return _gate_result(t, parts["dv"], dh0)


def _bwd_chunk_rewalk(saved: dict, dout, dfinal_state, dtape, dh0, rewalk: list) -> dict:
    """The `rewalk` segments' backward walk again (into dtape, dh0), and kda_bwd_chunk: the walk on a
    side stream on the SMs fit.rewalk_beside gives it, beside kda_bwd_chunk over the other segments'
    chunks, then kda_bwd_chunk over theirs; or (no such SM count) the walk first on every SM (alone,
    a rewalk runs on a GPU kda_bwd_chunk could fill: docs/cp.md)."""
    v = saved["v"]  # H below: the value heads
    lengths, H = saved["chain_lengths"], v.shape[2]
    runs = segment_runs(set(rewalk), len(lengths))
    t = bwd_chunk_tensors(saved, dout, dtape)
    sms = fit.rewalk_beside(tuple(lengths), tuple(rewalk), H, kda.device_sms(v.device))

    def walk_again(sm_count=None):
        for a, b in runs:
            chunk_kda_bwd_walk(kda.segments_view(saved, a, b), dout, dfinal_state[a:b],
                               out={"dtape": dtape, "dinitial_state": dh0[a:b]}, sm_count=sm_count,
                               pool="kda_bwd_walk/rewalk")
    if sms is None:
        walk_again()
        launch_bwd_chunk(t)
    else:
        first = (0, *itertools.accumulate(lengths))
        with kda.forked(v.device, 1, "rewalk") as (side,):
            with torch.cuda.stream(side):
                walk_again(sms)
            for inside, a, b in grouping.runs_of([s not in rewalk for s in range(len(lengths))]):
                if inside:
                    launch_bwd_chunk(t, first[a], first[b])
        for a, b in runs:
            launch_bwd_chunk(t, first[a], first[b])
    return {name: t[name] for name in _BWD_CHUNK_OUTPUTS}


def replay_bytes_per_head(T: int, n_chunks: int, n_segments: int = 0, grouped: bool = True) -> int:
    """Peak device bytes one head adds to a replay backward (chunk_kda_bwd with release): the
    replayed intermediates alive at kda_bwd_chunk (w, u, qg, kg, V', (I+L)^-1, and the forward's aqk and inv_pack:
    1,664 B a token; qg because the pipelined replay launches kda_bwd_chunk beside the backward walks, which read
    it: an over-count for the plain order, Options.pipeline off), its outputs (dv, dRk, dQg, dAqk and its lo part,
    dAkk in bf16, dKg, dAqk's diagonal, dbeta_v in fp32: 1,672 B a token), the two fp32 state tapes (128 KiB a
    chunk), the backward walk's d_initial_state (64 KiB a segment), and, when the heads run in groups
    (`grouped`), a group's copies of its inputs (q, k, v, dO, g, beta: 1,538 B a token; h0 and dht: 128 KiB a
    segment): one pass over every head reads the caller's tensors as they are."""
    state = kda.HEAD_DIM * kda.HEAD_DIM * 4
    copies = (1538, 2 * state) if grouped else (0, 0)
    return (T * (1664 + 1672 + copies[0]) + n_chunks * (2 * state + 2 * kda.HEAD_DIM * 4)
            + n_segments * (state + copies[1]))


def head_groups(H: int, per_head: int, available: int, max_heads: int = 0) -> list:
    """Split heads [0, H) into the fewest near-equal contiguous groups whose replay backward fits in
    `available` bytes (at least one head per group). Heads are independent in every kernel, so any
    grouping gives bitwise the same gradients. max_heads (if not 0) caps a group."""
    cap = max(1, available // max(per_head, 1))
    if max_heads:
        cap = min(cap, int(max_heads))
    n = -(-H // min(cap, H))
    bounds = [round(i * H / n) for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(n)]


def replay_tiles(bounds: tuple, chain_lengths: tuple, H: int, G: int, available: int, gradient_bytes: int,
                 max_heads: int = 0, max_tokens: int = 0) -> list:
    """How the replay backward covers a pack (segment `bounds`, `chain_lengths` chunks each) of H q, k heads with
    G value heads each in `available` bytes: tiles (s0, s1, h0, h1), segments [s0, s1) x q, k heads [h0, h1), run
    one after another. One tile, one pass, when it fits (priced without copies: it reads the caller's tensors as
    they are). Else runs of whole segments, the fewest in pack order, each over every head fitting beside the
    whole gradients allocated first (`gradient_bytes`): a run's tokens are one contiguous range of every tensor,
    read as views. A segment that alone does not fit is cut into head groups, whose slices are copied (priced
    with the copies). max_heads (value heads a tile) and max_tokens (tokens a run, unless it is one segment)
    force tiles (Options: tests and A/B arms)."""
    n, limit = len(bounds) - 1, max(1, max_heads // G) if max_heads else 0
    every = not limit or limit >= H
    first = (0, *itertools.accumulate(chain_lengths))

    def need(a, b, copies=False):  # bytes a head of segments [a, b) needs
        return G * replay_bytes_per_head(bounds[b] - bounds[a], first[b] - first[a], b - a, grouped=copies)
    if every and (not max_tokens or max_tokens >= bounds[n] - bounds[0]) and H * need(0, n) <= available:
        return [(0, n, 0, H)]
    left = available - gradient_bytes

    def fits(a, b):
        if max_tokens and b - a > 1 and bounds[b] - bounds[a] > max_tokens:
            return False
        return H * need(a, b) <= left
    tiles, a = [], 0
    while a < n:
        b = a + 1
        while fits(a, b) and b < n and fits(a, b + 1):
            b += 1
        heads = [(0, H)] if every and fits(a, b) else head_groups(H, need(a, b, copies=True), left, limit)
        tiles += [(a, b, h0, h1) for h0, h1 in heads]
        a = b
    return tiles


def _available_bytes(device) -> int:
    """Free device memory plus what torch's allocator holds but does not use, with a 15 % margin
    for fragmentation."""
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(0.85 * (free + cached))


_LAST_TILES: collections.OrderedDict = collections.OrderedDict()  # the tiles of the latest eager calls
_LAST_TILES_KEPT = 64  # as many packs as packing's table cache keeps


def _replay_tiles(tables, H: int, G: int, gradient_bytes: int, device) -> list:
    """replay_tiles for this pack on `device` (Options.max_heads, max_tokens). Under CUDA-graph capture no memory
    query is made: the tiles of the last eager call of this pack, shape and options are reused (warm up before
    capturing; a tiled call also needs each run's tables cached, packing's 64 packs at most)."""
    opts = options.current()
    key = (tables.bounds, H, G, gradient_bytes, opts.max_heads, opts.max_tokens, torch.device(device))
    if torch.cuda.is_current_stream_capturing():
        return _LAST_TILES.get(key, [(0, tables.n_segments, 0, H)])
    tiles = replay_tiles(tables.bounds, tables.chain_lengths, H, G, _available_bytes(device), gradient_bytes,
                         opts.max_heads, opts.max_tokens)
    _LAST_TILES[key] = tiles
    _LAST_TILES.move_to_end(key)
    while len(_LAST_TILES) > _LAST_TILES_KEPT:
        _LAST_TILES.popitem(last=False)
    return tiles


def replay_walks(prepared: dict, initial_state, dout, dfinal_state, need_dtape=True):
    """The replay's two walks over a chunk stage prepared with save_tape: the forward walk (tape and
    V', no output) and, when `dout` is given, the backward walk (dtape, d_initial_state) — which reads
    only the chunk stage's outputs — side by side: the forward walk on a side stream, each planned on
    half the SMs (their tails leave SMs idle that the other fills). Returns (saved context,
    [dtape, d_initial_state] or None; dtape None for need_dtape=False, the offset walk). Bitwise the
    same as the walks one after the other (Options.replay_overlap=False)."""
    v = prepared["v"]  # H below: the value heads
    T, H, C = v.shape[1], v.shape[2], prepared["chunks"].shape[0]
    # allocated here, on the current stream: the side stream only launches
    out = {"tape": torch.empty(C, H, kda.HEAD_DIM, kda.HEAD_DIM, device=v.device, dtype=torch.float32),
           "vnew": torch.empty(1, T, H, kda.HEAD_DIM, device=v.device, dtype=torch.bfloat16)}
    if dout is None or not options.current().replay_overlap:
        _, _, saved = kda.chunk_kda_walk(prepared, initial_state=initial_state, save_tape=True, out=out,
                                     want_output=False)
        walk = None if dout is None else list(chunk_kda_bwd_walk(prepared, dout, dfinal_state,
                                                                 need_dtape=need_dtape))
        return saved, walk
    half = replay_walk_sms(kda.device_sms(v.device))
    with kda.forked(v.device, 1, "replay") as (side,):
        with torch.cuda.stream(side):
            _, _, saved = kda.chunk_kda_walk(prepared, initial_state=initial_state, save_tape=True, out=out,
                                             want_output=False, sm_count=half)
        walk = list(chunk_kda_bwd_walk(prepared, dout, dfinal_state, need_dtape=need_dtape, sm_count=half))
    return saved, walk


def _replay_step(q, k, v, g, beta, h0, cu_seqlens, scale, do, dht, gate=None, beta_kind=kda.BETA_PLAIN, kept=None,
                 into=None):
    """One replay pass: the chunk stage, the two walks side by side (replay_walks; pipelined with
    the chunk stage unless Options.pipeline is off, kda_bwd_chunk then a group at a time behind them), then
    the chunk-parallel backward. Bitwise the same as the saved-context backward. kept: the forward's aqk and
    inv_pack (kda._chunk_stage_tensors), or None: the chunk stage forms them again. into: tensors the kernels
    write some gradients into (dv, dg, and dq, dk without grouped value heads), else they are allocated."""
    if kda._pipeline_on():
        saved, walk, parts = replay_walks_pipelined(q, k, v, g, beta, h0, cu_seqlens, scale, do, dht, gate=gate,
                                                    beta_kind=beta_kind, bwd_chunk=True, kept=kept, into=into)
        return chunk_kda_bwd(saved, do, dht, release=True, walk=walk, parts=parts)
    prepared = kda.chunk_kda_prepare(q, k, v, g, beta, cu_seqlens=cu_seqlens, scale=scale, initial_state=h0,
                                     save_tape=True, gate=gate, beta_kind=beta_kind, kept=kept)
    saved, walk = replay_walks(prepared, h0, do, dht)
    del prepared  # `saved` alone holds the intermediates now: release frees them as it goes
    if into:
        saved["into"] = into
    return chunk_kda_bwd(saved, do, dht, release=True, walk=walk)


def replay_walks_pipelined(q, k, v, g, beta, h0, cu_seqlens, scale, do, dht, skip_bwd=(), pieced=False,
                            gate=None, beta_kind=kda.BETA_PLAIN, bwd_chunk=False, kept=None, into=None):
    """The replay's chunk stage and walks in the pipelined order (plan.replay_plan, run by execute.run):
    each group's forward walk (tape, V') and backward walk (dtape, d_initial_state) on two side streams,
    planned on half the SMs as in replay_walks. Returns what replay_walks returns (with bwd_chunk, a third value
    below); bitwise the same. (kda_bwd_chunk runs behind the walks only after the last chunk stage, bwd_chunk
    below, not beside the later groups' chunk stages: the step is bound by the sum of its kernels' SM time,
    docs/backward.md.) skip_bwd (context parallelism):
    segments whose backward walk is left out (their dtape and d_initial_state rows stay unwritten):
    the caller walks them again anyway, with exit-state gradients it does not have yet.
    pieced (context parallelism): the longest chain's chunk stage a piece at a time (grouping.pieced_group),
    first and last piece first, then the second and the last but one, ...: its forward walk goes
    through the pieces from the front, its backward walk from the back, each piece from its neighbour's
    end state (fp32, stored and loaded exactly: bitwise the one walk), so both start after one piece's
    chunk stage instead of the whole chain's, which otherwise runs alone before them (docs/cp.md).
    bwd_chunk (one GPU): the plan launches kda_bwd_chunk as well, each group's chunks once its walks are done,
    beside the later groups' walks (plan._bwd_chunk_joins); its outputs come third in what is returned
    (chunk_kda_bwd's parts) and the walk's dtape is None (only kda_bwd_chunk read it).
    kept: as _replay_step's."""
    prepared = kda._chunk_stage_tensors(q, k, v, g, beta, cu_seqlens, scale, h0, True, gate=gate,
                                        beta_kind=beta_kind, kept=kept)
    _check_dout(do, v)
    do = do.contiguous()  # once, not per group
    H = v.shape[2]
    N, C = len(prepared["chain_lengths"]), prepared["chunks"].shape[0]
    outs = kda._walk_outputs(v, N, C, None, save_tape=True, want_output=False, output_final_state=False)
    dtape = torch.empty(C, H, kda.HEAD_DIM, kda.HEAD_DIM, device=q.device, dtype=torch.float32)
    dh0 = torch.empty(N, H, kda.HEAD_DIM, kda.HEAD_DIM, device=q.device, dtype=torch.float32)
    plan = replay_plan(prepared["chain_lengths"], H, kda.device_sms(q.device), pieced=pieced, skip_bwd=skip_bwd,
                       bwd_chunk=bwd_chunk)
    piece_chunks, handoff = execute.piece_buffers(plan, H, q.device, ("fwd_handoff", "bwd_handoff"))
    buffers = {"initial_state": h0, "dfinal_state": dht, "dinitial_state": dh0, **handoff}
    saved = dict(prepared, initial_state=h0, **outs)
    if into:  # only a tile's: otherwise saved holds what replay_walks' does
        saved["into"] = into
    launched = None
    if bwd_chunk:  # allocated before the walks: qg (the backward walk's) is alive beside them, replay_bytes_per_head
        launched = bwd_chunk_tensors(saved, do, dtape)
    execute.run(plan, execute.Call(prepared, buffers, outs, save_tape=True, want_output=False, dout=do, dtape=dtape,
                                   piece_chunks=piece_chunks, bwd_chunk=launched))
    if not bwd_chunk:
        return saved, [dtape, dh0]
    return saved, [None, dh0], {name: launched[name] for name in _BWD_CHUNK_OUTPUTS}


def replay_backward(q, k, v, g, beta, h0, cu_seqlens, scale, do, dht, gate=None, beta_kind=kda.BETA_PLAIN,
                    kept=None):
    """Replay backward in one pass, or a tile (a run of whole segments x a group of heads) at a time as memory
    allows (replay_tiles; every tiling bitwise the one pass: segments and heads are independent in every kernel).
    With gate (a kda.GateActivation) it returns the parts of dA_log and ddt_bias after the six gradients
    (_gate_result). With grouped value heads a head group is whole q, k heads, each with its value heads.
    beta_kind (kda.BETA_KINDS): beta is the logits and dbeta their gradient. kept: what the forward kept for the
    replay's chunk stage (kda.REPLAY_KEPT's tensors: kda._chunk_stage_tensors), or None."""
    T, H = v.shape[1], v.shape[2]
    tables = kda.tables_of(cu_seqlens, T, q.device)
    C = tables.chunks.shape[0]
    gradient_bytes = (2 * q.nbytes + v.nbytes + g.nbytes + 4 * T * H
                      + tables.n_segments * H * kda.HEAD_DIM * kda.HEAD_DIM * 4
                      + (C * H * (2 + kda.HEAD_DIM) * 4 if gate is not None else 0))
    tiles = _replay_tiles(tables, q.shape[2], H // q.shape[2], gradient_bytes, q.device)
    if len(tiles) == 1:
        return _replay_step(q, k, v, g, beta, h0, cu_seqlens, scale, do, dht, gate, beta_kind, kept)
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
             torch.empty(beta.shape, device=q.device, dtype=torch.float32),
             torch.empty(tables.n_segments, H, kda.HEAD_DIM, kda.HEAD_DIM, device=q.device, dtype=torch.float32))
    if gate is not None:
        grads += (torch.empty(C, H, 2, device=q.device, dtype=torch.float32),
                  torch.empty(C, H, kda.HEAD_DIM, device=q.device, dtype=torch.float32))
    first = (0, *itertools.accumulate(tables.chain_lengths))
    for a, b, qa, qb in tiles:
        _replay_tile(grads, (a, b), (first[a], first[b]), (qa, qb), q, k, v, g, beta, h0, tables, scale, do, dht,
                     gate, beta_kind, kept)
    return grads


def _replay_tile(grads, segments, chunks, qk_heads, q, k, v, g, beta, h0, tables, scale, do, dht, gate, beta_kind,
                 kept):
    """Segments [a, b) (chunks [c0, c1)) x q, k heads [qa, qb) of the replay into `grads`. The segments' tokens
    are one contiguous range of every per-token tensor: over every head the tile reads views of them, and the
    kernels write dv, dg (and dq, dk without grouped value heads) into its rows of the whole gradients; over
    some heads it copies their slices in and its gradients out."""
    (a, b), (c0, c1), (qa, qb) = segments, chunks, qk_heads
    G = v.shape[2] // q.shape[2]
    va, vb = qa * G, qb * G  # the value heads
    t0, t1 = tables.bounds[a], tables.bounds[b]
    every = qb - qa == q.shape[2]
    cu = torch.tensor([x - t0 for x in tables.bounds[a:b + 1]], dtype=torch.int32)
    qk = lambda x: x[:, t0:t1, qa:qb]  # noqa: E731
    rows = lambda x: None if x is None else x[:, t0:t1, va:vb]  # noqa: E731
    segs = lambda x: None if x is None else x[a:b, va:vb]  # noqa: E731
    # a copy only where the tile leaves heads out: over every head each slice is a contiguous view already
    given = lambda x: None if x is None else x.contiguous()  # noqa: E731
    into = None
    if every:  # the kernels write into the tile's rows of the whole gradients
        into = {"dv": rows(grads[2]), "dg": rows(grads[3])}
        if G == 1:
            into.update(dq=qk(grads[0]), dk=qk(grads[1]))
    got = _replay_step(given(qk(q)), given(qk(k)), given(rows(v)), given(rows(g)), given(rows(beta)),
                       given(segs(h0)), cu, scale, given(rows(do)), given(segs(dht)),
                       gate.heads(va, vb) if gate is not None and not every else gate, beta_kind,
                       None if kept is None else {name: given(rows(x)) for name, x in kept.items()}, into)
    for place, x in ((qk(grads[0]), got[0]), (qk(grads[1]), got[1]), (rows(grads[2]), got[2]),
                     (rows(grads[3]), got[3]), (rows(grads[4]), got[4]), (segs(grads[5]), got[5])):
        if x.data_ptr() != place.data_ptr():
            place.copy_(x)
    if gate is not None:
        grads[6][c0:c1, va:vb].copy_(got[6])
        grads[7][c0:c1, va:vb].copy_(got[7])
