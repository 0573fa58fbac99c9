"""Every record of kda_aot in one table.

A *program* is a kernel family (one folder under templates/), a *record* one rendered instance
of it (template + parameters + arch), a *form* the name the runtime picks it by. Shipped records
go to build.json and into the wheel; test-only records go to build.test.json and are built only
when asked (KDA_AOT_TEST_RECORDS=1), to check a shipped record against another form.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

# The arch table: every record is rendered once per arch it lists (default: all of these); the wheel is
# built for one of them (setup.py, KDA_AOT_ARCH). A second arch is a row here, and `archs=` on the
# records that do not serve it.
ARCHS = ("sm_90a",)

# nvcc flags common to every kernel unit; the -gencode pair follows from the arch.
NVCC_FLAGS = ("-O3", "-std=c++17", "-lineinfo", "-Xcompiler=-fPIC", "-Xcompiler=-fvisibility=hidden")


def gencode(arch: str) -> str:
    """sm_90a -> -gencode=arch=compute_90a,code=sm_90a (the 'a' features need this form)."""
    num = arch.removeprefix("sm_")
    return f"-gencode=arch=compute_{num},code=sm_{num}"


@dataclass(frozen=True)
class Binding:
    """The binding unit of a program whose launch takes one of the shared KDA argument structs (KdaFwdArgs or
    KdaBwdArgs, templates/common/kda.h; one template for both) and the tensors a launch must be given."""
    args: str             # "Fwd" or "Bwd": the argument struct Kda<args>Args
    needs: tuple
    need_one: tuple = ()  # tensors of which a launch must be given at least one
    # the program reads the gate (kda_fwd_chunk, kda_bwd_gate) and can form it from the raw gate (its launch
    # takes gate_kind and lower_bound)
    gate: bool = False
    beta: bool = False    # the program reads beta, formed from the logits on load (its launch takes beta_kind)
    template = "common/kda_binding.cpp.j2"  # a class attribute, not a field: the same for every binding


_FWD_ARGS, _BWD_ARGS = "Fwd", "Bwd"
_GATE_NEEDS = ("q", "k", "g", "beta", "chunks", "seg_chunks", "daqk", "daqk_lo", "dakk", "daqk_diag", "dqg", "dkg",
               "drk", "dbeta_v", "dgam_s", "dq", "dk", "dg")
# Programs on KdaFwdArgs / KdaBwdArgs (templates/common/kda.h), by program or by "program/form" where a form's
# tensors differ; every other program's folder holds its own binding.cpp.j2.
BINDINGS = {
    "kda_fwd_chunk": Binding(_FWD_ARGS, ("q", "k", "v", "g", "beta", "chunks", "seg_chunks", "w", "u", "qg", "kg",
                                         "aqk", "aqk_diag_lo", "gamma"), gate=True, beta=True),
    "kda_fwd_chunk/replay": Binding(_FWD_ARGS, ("q", "k", "v", "g", "beta", "chunks", "seg_chunks", "w", "u", "qg",
                                                "kg", "gamma", "inv_pack", "akk_inv"), gate=True, beta=True),
    # kda_fwd_walk also needs aqk_diag_lo when it writes o (the binding checks: the replay's walk writes none)
    "kda_fwd_walk": Binding(_FWD_ARGS, ("q", "chunks", "seg_chunks", "w", "u", "qg", "kg", "aqk", "gamma")),
    "kcp_transfer": Binding(_FWD_ARGS, ("q", "chunks", "seg_chunks", "w", "kg", "gamma", "transfer")),
    # without dtape the offset walk (the entering-state gradients context parallelism sends)
    "kda_bwd_walk": Binding(_BWD_ARGS, ("dout", "chunks", "seg_chunks", "w", "qg", "kg", "aqk", "gamma"),
                            need_one=("dtape", "dinitial_state")),
    "kda_bwd_chunk": Binding(_BWD_ARGS, ("dout", "chunks", "seg_chunks", "w", "kg", "aqk", "gamma", "dtape", "v", "u",
                                         "vnew", "akk_inv", "beta", "tape", "dv", "drk", "dqg", "dkg", "daqk", "daqk_lo",
                                         "dakk", "daqk_diag", "dbeta_v", "dgam_s"), beta=True),
    "kda_bwd_gate/full": Binding(_BWD_ARGS, _GATE_NEEDS + ("dbeta",), gate=True, beta=True),
    # two CTAs over 64 channels each write dbeta's halves (the caller adds them)
    "kda_bwd_gate/split_staged": Binding(_BWD_ARGS, _GATE_NEEDS + ("dbeta_part",), gate=True, beta=True),
}


@dataclass(frozen=True)
class Record:
    program: str          # templates/<program>/ holds kernel.cu.j2 (and binding.cpp.j2 unless BINDINGS names one)
    form: str             # what the runtime selects by
    params: dict          # rendered into the templates; part of the hash
    select: str           # when the runtime picks this form
    grid: str             # the launch grid, as a formula
    shipped: bool = True  # build.json (wheel) or build.test.json (tests only)
    archs: tuple = ARCHS  # the archs it is rendered for
    arch: str = ""        # the one arch of a rendered record (set by the table below)
    toolkit_floor: str = "12.3"   # oldest CUDA toolkit known to compile it
    extra_flags: tuple = field(default_factory=tuple)

    @property
    def module(self) -> str:
        """Python extension module the record compiles to (one per (program, form) per wheel)."""
        return f"kda_aot._lib._{self.program}__{self.form}"

    @property
    def flags(self) -> tuple:
        return NVCC_FLAGS + (gencode(self.arch),) + tuple(self.extra_flags)

    @property
    def binding(self) -> Binding | None:
        """BINDINGS' entry for this form ("program/form"), else the program's, else None (its own template)."""
        return BINDINGS.get(f"{self.program}/{self.form}") or BINDINGS.get(self.program)

    @property
    def templates(self) -> dict:
        """{unit suffix: template path under templates/}: the kernel's and the binding's."""
        binding = self.binding
        return {"kernel.cu": f"{self.program}/kernel.cu.j2",
                "binding.cpp": binding.template if binding else f"{self.program}/binding.cpp.j2"}


_CONV_GRID = "ceil(ceil(T / tokens_per_thread) * D / channels / threads) CTAs of `threads`; thread = (token tile, channels)"

_FWD = "conv1d_silu_fwd"
_BWD = "conv1d_silu_bwd"
_BWD_GRID = _CONV_GRID + "; then ceil(5 * D / reduce_threads) CTAs reduce dweight/dbias over tiles"
_VARIANT = "tests and benchmarks only: a tiling variant, bitwise equal in y/dx/dhalo to the shipped form"

_RECORDS_BY_PROGRAM: tuple[Record, ...] = (
    Record(program=_FWD, form="default",
           params={"threads": 256, "tokens_per_thread": 64, "channels": 4, "unroll": 8, "min_blocks": 2,
                   "l2norm": False},
           select="the conv alone (v; q and k without the norm)", grid=_CONV_GRID),
    Record(program=_BWD, form="default",
           params={"threads": 128, "tokens_per_thread": 256, "channels": 4, "unroll": 8, "min_blocks": 2,
                   "reduce_threads": 256, "l2norm": False},
           select="the conv alone (v; q and k without the norm)", grid=_BWD_GRID),
    # The per-head L2 norm of q and k fused into their conv (PackedKDA, CUDA backend, head dim 128): saves
    # the norm's own pass over each tensor both ways (docs/conv.md). l2norm_eps = kda_aot.reference.L2NORM_EPS (tested).
    Record(program=_FWD, form="l2norm",
           params={"threads": 256, "tokens_per_thread": 64, "channels": 4, "unroll": 8, "min_blocks": 2,
                   "l2norm": True, "l2norm_eps": "1e-6f", "norm_batch": 8},
           select="q and k of PackedKDA with qk_l2norm (head dim 128)", grid=_CONV_GRID),
    Record(program=_BWD, form="l2norm",
           params={"threads": 128, "tokens_per_thread": 256, "channels": 4, "unroll": 8, "min_blocks": 2,
                   "reduce_threads": 256, "l2norm": True, "l2norm_eps": "1e-6f", "norm_batch": 4},
           select="q and k of PackedKDA with qk_l2norm (head dim 128)", grid=_BWD_GRID),
    # Short tiles put a tile edge every few tokens: bitwise checks against the shipped form prove the
    # tile-edge and document-edge logic of the window walk.
    Record(program=_FWD, form="short_tiles",
           params={"threads": 128, "tokens_per_thread": 5, "channels": 8, "unroll": 2, "min_blocks": 1,
                   "l2norm": False},
           select=_VARIANT, grid=_CONV_GRID, shipped=False),
    Record(program=_BWD, form="short_tiles",
           params={"threads": 128, "tokens_per_thread": 5, "channels": 8, "unroll": 3, "min_blocks": 1,
                   "reduce_threads": 128, "l2norm": False},
           select=_VARIANT + " (dweight/dbias differ in summation order only)", grid=_BWD_GRID, shipped=False),
    # The l2norm forms with a tile edge every few tokens and one row per norm batch: bitwise checks against
    # the shipped l2norm forms prove that their rows' head sums taken side by side in batches (interior)
    # give what one row at a time gives (edges).
    Record(program=_FWD, form="l2norm_short_tiles",
           params={"threads": 128, "tokens_per_thread": 5, "channels": 4, "unroll": 2, "min_blocks": 1,
                   "l2norm": True, "l2norm_eps": "1e-6f", "norm_batch": 1},
           select=_VARIANT, grid=_CONV_GRID, shipped=False),
    Record(program=_BWD, form="l2norm_short_tiles",
           params={"threads": 128, "tokens_per_thread": 5, "channels": 4, "unroll": 2, "min_blocks": 1,
                   "reduce_threads": 256, "l2norm": True, "l2norm_eps": "1e-6f", "norm_batch": 1},
           select=_VARIANT, grid=_BWD_GRID, shipped=False),
    # The chunk stage: its schedule and the measurements behind it, docs/forward.md.
    Record(program="kda_fwd_chunk", form="lean", params={"threads": 256, "profile": False, "replay": False},
           select="always: Akk/Aqk tiles spread over the warps by table, Gamma in log2 units, the Akk/Aqk "
                  "operands as packed bf16 products, (I + L)^-1 on the tensor cores in 3xTF32",
           grid="(n_chunks, H) CTAs of 256 threads; Akk/Aqk phase: warp -> (row block, column tiles) by table"),
    # The replay's chunk stage: tril(Aqk) and inv_pack (T_c and (I + L)^-1) from the forward, not formed again.
    Record(program="kda_fwd_chunk", form="replay", params={"threads": 256, "profile": False, "replay": True},
           select="the replay backward's chunk stage, when the forward kept aqk and inv_pack (chunk_kda's replay)",
           grid="as lean"),
    Record(program="kda_fwd_chunk", form="lean_prof", params={"threads": 256, "profile": True, "replay": False},
           select="bench/chunk_profile.py only: `lean` writing clock64 cycles per phase into gamma",
           grid="as lean", shipped=False),
    # Walk forms: with few chains, quarter (at most SM/4) and split (at most SM/2) walk a chain
    # faster than full; with two split CTAs per SM split is slower. All three ship and the fit rule
    # (kda_aot/schedule/fit.py and its per-GPU table, measured by bench/measure_rho.py) picks per launch:
    # docs/fit_rule.md.
    # The forward walk's products run on wgmma (S, V' read from shared memory once per warpgroup), O leaves
    # through shared memory in whole rows, and `full` splits every product between its warpgroups by
    # value-column halves; split and quarter keep the warpgroup roles, because ptxas serializes the
    # column-halves form at two CTAs per SM (registers). Why each pays: docs/forward.md. Every form of
    # either kind computes every element bitwise the same (the forms tests check it).
    Record(program="kda_fwd_walk", form="full", params={"threads": 256, "columns": 128, "stages": 2, "min_blocks": 1,
                                                        "vsplit": True, "profile": False},
           select="the fit rule (kda_aot/schedule/fit.py): many chains (more than SM/2 for equal lengths)",
           grid="(N segments, H) CTAs of 256 threads; one CTA walks a segment's chunks (128 value columns), output "
                "fused; warpgroup g: W S, Q S, V', Aqk V' and O for value columns 64 g .., its state rows' update"),
    Record(program="kda_fwd_walk", form="split", params={"threads": 256, "columns": 64, "stages": 1, "min_blocks": 2,
                                                         "vsplit": False, "profile": False},
           select="the fit rule (kda_aot/schedule/fit.py): few long chains; bitwise equal to `full`",
           grid="(N segments, H, 2) CTAs of 256 threads; 64 value columns each, two resident per SM; warpgroup 0: "
                "W S and V', warpgroup 1: Q S and O, each its half of the state update"),
    Record(program="kda_fwd_walk", form="quarter", params={"threads": 256, "columns": 32, "stages": 2, "min_blocks": 1,
                                                           "vsplit": False, "profile": False},
           select="the fit rule (kda_aot/schedule/fit.py): at most SM/4 chains, each of the four CTAs on an SM of its own; "
                  "bitwise equal to `full`",
           grid="(N segments, H, 4) CTAs of 256 threads; 32 value columns each; warpgroup roles as split"),
    Record(program="kda_fwd_walk", form="full_prof", params={"threads": 256, "columns": 128, "stages": 2,
                                                             "min_blocks": 1, "vsplit": True, "profile": True},
           select="bench/walk_profile.py only: `full` writing clock64 cycles per phase of a step",
           grid="as full", shipped=False),
    # The backward walk: full on wgmma (dS, dO, -dV' read from shared memory once per
    # warpgroup; warpgroup g forms dV' for column half g and updates dS rows 64 g ..; the previous
    # chunk's tiles issued during the products), faster than on mma.sync. A wgmma split form spills at
    # two CTAs per SM and slows the steps that pick split: split and quarter stay on mma.sync
    # (docs/backward.md). Bitwise equal across the kinds (the forms tests check it).
    Record(program="kda_bwd_walk", form="full", params={"threads": 256, "columns": 128, "stages": 2, "min_blocks": 1,
                                                        "wgmma": True},
           select="the fit rule (kda_aot/schedule/fit.py): many chains (more than SM/2 for equal lengths)",
           grid="(N segments, H) CTAs of 256 threads; one CTA walks a segment's chunks backwards, 128 value columns"),
    Record(program="kda_bwd_walk", form="split", params={"threads": 256, "columns": 64, "stages": 1, "min_blocks": 2,
                                                        "wgmma": False},
           select="the fit rule (kda_aot/schedule/fit.py): few long chains; bitwise equal to `full`",
           grid="(N segments, H, 2) CTAs of 256 threads; 64 value columns each, two resident per SM"),
    Record(program="kda_bwd_walk", form="quarter", params={"threads": 256, "columns": 32, "stages": 2, "min_blocks": 1,
                                                        "wgmma": False},
           select="the fit rule (kda_aot/schedule/fit.py): at most SM/4 chains, each of the four CTAs on an SM of its own; "
                  "bitwise equal to `full`",
           grid="(N segments, H, 4) CTAs of 256 threads; 32 value columns each"),
    Record(program="kda_bwd_chunk", form="default", params={"threads": 256},
           select="always (the plain-product half of the chunk-parallel backward)",
           grid="(n_chunks, H) CTAs of 256 threads; warp w = (rows 16 (w % 4) .., column half w / 4)"),
    # The gated half: two CTAs per SM with the bf16 inputs in shared memory ship, as the latency-bound gate
    # gains most from both (the four forms measured: docs/backward.md); one CTA over all channels stays as
    # the check of the channel split.
    Record(program="kda_bwd_gate", form="split_staged",
           params={"threads": 256, "columns": 64, "min_blocks": 2, "staged": True},
           select="always (the gated half of the chunk-parallel backward): two CTAs per (chunk, head) over 64 "
                  "channels each, two resident per SM, dQg/dRk/dKg staged in shared memory (110 KB)",
           grid="(n_chunks, H, 2) CTAs of 256 threads over 64 channels each; warp w = (rows 16 (w % 4) .., "
                "32 channels w / 4)"),
    Record(program="kda_bwd_gate", form="full", params={"threads": 256, "columns": 128, "min_blocks": 1, "staged": False},
           select="tests only: one CTA per (chunk, head) over all 128 channels (255 registers, one per SM), the "
                  "check of split_staged's channel split (test_kda_bwd_gpu.py::test_gate_forms_match_shipped: dq, "
                  "dk, dg bitwise equal; dbeta summed in another order)",
           grid="(n_chunks, H) CTAs of 256 threads; warp w = (rows 16 (w % 4) .., channel half w / 4)",
           shipped=False),
    Record(program="kcp_transfer", form="full", params={"threads": 256},
           select="always (context parallelism: M of each fragment)",
           grid="(N segments, H) CTAs of 256 threads; one CTA composes a segment's chunk maps"),
    # Per-head L2 norm of q and k (PackedKDA's qk_l2norm): bandwidth-bound rows of 128 bf16.
    Record(program="l2norm_fwd", form="default", params={"threads": 256, "rows_per_group": 4},
           select="always (PackedKDA's qk_l2norm and chunk_kda's use_qk_l2norm_in_kernel on the GPU)",
           grid="min(ceil(rows / 4 / 16), 2^20) CTAs of 256 threads; 16 lanes per row, grid-stride",),
    Record(program="l2norm_bwd", form="default", params={"threads": 256, "rows_per_group": 2},
           select="always (PackedKDA's qk_l2norm and chunk_kda's use_qk_l2norm_in_kernel on the GPU)",
           grid="min(ceil(rows / 2 / 16), 2^20) CTAs of 256 threads; 16 lanes per row, grid-stride",),
)


# Records x archs: one rendered record per (record, arch it lists).
RECORDS: tuple[Record, ...] = tuple(replace(r, arch=a) for r in _RECORDS_BY_PROGRAM for a in r.archs)
assert all(r.arch in ARCHS for r in RECORDS), "a record lists an arch outside ARCHS"


def records(arch: str | None = None) -> list[Record]:
    return [r for r in RECORDS if arch is None or r.arch == arch]
