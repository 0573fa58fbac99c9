"""The fit rule: list scheduling, the form decision, a forced walk form, the cache."""
import logging
from pathlib import Path

import pytest

from kda_aot.schedule import fit, grouping, plan


@pytest.fixture(autouse=True)
def fresh_caches():
    """Decisions and measurements are cached process-wide: every test starts and ends without them
    (also when an assertion fails), so no monkeypatched value leaks into another test."""
    plan.cache_clear()  # the plans and every fit decision they read
    yield
    plan.cache_clear()


def test_makespan_in_launch_order():
    assert fit.makespan([], 4) == 0
    assert fit.makespan([1, 1, 4], 2) == 5         # taken in order, not longest first (that gives 4)
    assert fit.makespan([5, 3, 3, 2], 2) == 7      # 5+2 | 3+3
    assert fit.makespan([10, 1, 1, 1], 8) == 10    # one long chain dominates
    assert fit.makespan([4] * 9, 8) == 8           # one wave plus one


def test_predicted_makespans():
    # Q1-like: 4 documents x 32 heads = 128 chains on 132 SMs, longest 1585 chunks
    lengths = (1585, 641, 1216, 465)
    assert fit.predicted(lengths, 32, 132, rho=0.55) == pytest.approx({"full": 1585.0, "split": 0.55 * 1585})
    spans = fit.predicted(lengths, 32, 132, rho=1.05)
    assert spans["split"] > spans["full"]          # the longest chain sets both; a dearer step loses
    many = tuple([3] * 500)                        # 16,000 short chains: 122 waves either way
    assert fit.predicted(many, 32, 132, rho=1.05) == pytest.approx({"full": 366.0, "split": 122 * 3 * 1.05})
    assert fit.predicted(many, 32, 132, rho=0.6)["split"] < 366.0


def test_few_chains_use_the_alone_cost():
    # 2 documents x 1 head: 4 split CTAs on 132 SMs, each alone on its SM
    assert fit.predicted((900, 300), 1, 132, rho=1.05, rho_alone=0.6) == pytest.approx({"full": 900.0,
                                                                                        "split": 540.0})
    # 66 chains: 132 split CTAs, still one per SM; 67 chains: some SMs host two (shared cost)
    assert fit.predicted((100,), 66, 132, rho=1.05, rho_alone=0.6)["split"] == pytest.approx(60.0)
    assert fit.predicted((100,), 67, 132, rho=1.05, rho_alone=0.6)["split"] == pytest.approx(105.0)


def test_forced_walk_form_and_unmeasured_rho(monkeypatch, kda_options, caplog):
    fit._decide.cache_clear()
    monkeypatch.setattr(fit, "measured_rho", lambda: {})
    with caplog.at_level(logging.INFO, logger="kda_aot.schedule.fit"):
        assert fit.plan_walk("kda_fwd_walk", (1585, 641), 32, 132, "auto") == (("full", 0, 2),)
    assert "rho not measured" in caplog.text
    assert fit.plan_walk("kda_fwd_walk", (1585, 641), 32, 132, "split") == (("split", 0, 2),)
    kda_options(walk_form="split")
    assert fit.plan_walk("kda_fwd_walk", (3, 3), 1, 132) == (("split", 0, 2),)
    assert fit.plan_walk("kda_fwd_walk", (3, 3), 1, 132, "quarter") == (("quarter", 0, 2),)
    with pytest.raises(ValueError, match="walk_form: expected one of"):
        fit.plan_walk("kda_fwd_walk", (3,), 1, 132, "half")


def test_measured_rho_decides_and_decisions_are_cached(monkeypatch):
    q1 = (1585, 641, 1216, 465)
    fit._decide.cache_clear()
    monkeypatch.setattr(fit, "measured_rho", lambda: {"kda_fwd_walk": (0.55, 0.55)})
    assert fit.plan_walk("kda_fwd_walk", q1, 32, 132, "auto") == (("split", 0, 4),)
    hits = fit._decide.cache_info().hits
    assert fit.plan_walk("kda_fwd_walk", q1, 32, 132, "auto") == (("split", 0, 4),)
    assert fit._decide.cache_info().hits == hits + 1  # the second launch is a dictionary lookup
    fit._decide.cache_clear()
    monkeypatch.setattr(fit, "measured_rho", lambda: {"kda_fwd_walk": (1.05, 0.6)})
    assert fit.plan_walk("kda_fwd_walk", q1, 1, 132, "auto") == (("split", 0, 4),)   # 4 chains: alone
    fit._decide.cache_clear()


def test_mixed_plans(monkeypatch):
    """The k longest documents split, the rest full on the SMs left over, one launch per run."""
    fit._decide.cache_clear()
    monkeypatch.setattr(fit, "measured_rho", lambda: {"kda_fwd_walk": (1.15, 0.62)})
    q1 = (1585, 641, 1216, 465)
    # Q1 at 32 heads: the 1,585-chunk document split on 64 SMs (0.62 x 1585 = 983), the other 96
    # chains full on the other 68 SMs in launch order (641, 1216, 465 per head): 68 start at once,
    # a 1,216-chunk chain queues behind a 641-chunk one (1857). Longest first would give 1216 and
    # pick this plan; the H200 ran it 8 % slower than full (docs/fit_rule.md): full it is.
    assert fit.mixed_makespan(q1, 32, 132, {0}, 0.62) == pytest.approx(641.0 + 1216.0)
    assert fit.plan_walk("kda_fwd_walk", q1, 32, 132, "auto") == (("full", 0, 4),)
    # Q4 at 32 heads: 64 full chains on 68 free SMs, no queue: the mixed plan
    assert fit.plan_walk("kda_fwd_walk", (1875, 1253, 625), 32, 132, "auto") == (("split", 0, 1), ("full", 1, 3))
    # no SM left for the full chains: not a candidate
    assert fit.mixed_makespan(q1, 33, 132, {0, 2}, 0.62) is None
    # the longest in the middle would take three runs (predicted 1648 against 1973 steps full): more than
    # MAX_RUNS, full (Q3's saved step ran 2.0-2.3 % slower with them on the H200)
    assert fit.mixed_makespan((1025, 193, 1563, 487, 625, 205), 32, 132, {2}, 0.62) < 1973
    assert fit.plan_walk("kda_fwd_walk", (1025, 193, 1563, 487, 625, 205), 32, 132, "auto") == (("full", 0, 6),)
    # equal lengths, many chains: full (no idle SMs to win)
    assert fit.plan_walk("kda_fwd_walk", (797, 797, 797, 813, 782), 32, 132, "auto") == (("full", 0, 5),)
    # more runs than MAX_RUNS are never planned: splitting the six long documents of an alternating
    # pack at 8 heads (96 split CTAs, 48 full chains on 36 SMs) would beat uniform full but takes 12 runs
    alternating = tuple([1000, 10] * 6)
    assert fit.mixed_makespan(alternating, 8, 132, {0, 2, 4, 6, 8, 10}, 0.62) == pytest.approx(620.0)
    assert fit.plan_walk("kda_fwd_walk", alternating, 8, 132, "auto") == (("full", 0, 12),)
    assert grouping.runs_of(["full", "split", "split", "full"]) == (("full", 0, 1), ("split", 1, 3), ("full", 3, 4))
    # a mixed plan must beat the best uniform one by 5 % (its extra launches and stream fork/join):
    # 1000 vs 960 steps (4 %) stays uniform, 1000 vs 900 (10 %) goes mixed
    assert fit.mixed_makespan((1000, 960, 960), 32, 132, {0}, 0.62) == pytest.approx(960.0)
    assert fit.plan_walk("kda_fwd_walk", (1000, 960, 960), 32, 132, "auto") == (("full", 0, 3),)
    assert fit.plan_walk("kda_fwd_walk", (1000, 900, 900), 32, 132, "auto") == (("split", 0, 1), ("full", 1, 3))
    fit._decide.cache_clear()


def test_quarter_form_when_measured(monkeypatch):
    """quarter enters `auto` with a measured rho_quarter_alone, and only when each of its CTAs gets
    an SM of its own (4 x chains <= SMs)."""
    monkeypatch.setattr(fit, "measured_rho", lambda: {"kda_fwd_walk": (1.15, 0.62, 0.4)})
    assert fit.plan_walk("kda_fwd_walk", (2000,), 32, 132, "auto") == (("quarter", 0, 1),)   # 128 CTAs
    assert fit.plan_walk("kda_fwd_walk", (2000,), 40, 132, "auto") == (("split", 0, 1),)     # 160 > 132


def test_quarter_step_cost_is_read_only_where_quarter_ships(monkeypatch, tmp_path):
    params = tmp_path / "fit_params.json"
    params.write_text('{"programs": {"kda_fwd_walk": {"rho": 1.15, "rho_alone": 0.62, "rho_quarter_alone": 0.4}}}')
    monkeypatch.setattr(fit, "PARAMS_FILE", params)
    monkeypatch.setattr(fit, "QUARTER_SHIPPED", frozenset())
    assert fit.measured_rho()["kda_fwd_walk"] == (1.15, 0.62, None)       # quarter not shipped: ignored
    monkeypatch.setattr(fit, "QUARTER_SHIPPED", frozenset({"kda_fwd_walk"}))
    fit.measured_rho.cache_clear()
    assert fit.measured_rho()["kda_fwd_walk"] == (1.15, 0.62, 0.4)


def test_quarter_shipped_matches_the_wheel_manifest():
    """QUARTER_SHIPPED names exactly the programs whose quarter record build.json ships."""
    from kda_aot._runtime import registry
    shipped = [r for r in registry.records() if r["shipped"]]
    assert fit.QUARTER_SHIPPED == {r["program"] for r in shipped if r["form"] == "quarter"}


def test_the_package_carries_the_measured_step_costs():
    """The fit rule reads its parameters from the package's table for the H200: both tape walks measured,
    and the pipeline's costs."""
    assert fit.params_file("NVIDIA H200") == Path(fit.__file__).parent / "fit_params" / "nvidia_h200.json"
    assert fit.gpu_key("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    if fit.current_gpu() == fit.MEASURED_GPU:
        assert {"kda_fwd_walk", "kda_bwd_walk"} <= set(fit.measured_rho())
        assert fit.walk_step_us("kda_fwd_walk") > 0
        assert fit.pipeline_params()["chunk_stage_slowdown_beside_walk"] == {1: 2.0, 2: 3.4}


def test_missing_params_file_is_an_error(monkeypatch, tmp_path):
    """Without the H200's table `auto` would quietly keep `full` everywhere: it raises, naming the file."""
    monkeypatch.setattr(fit, "PARAMS_DIR", tmp_path)
    monkeypatch.setattr(fit, "current_gpu", lambda: fit.MEASURED_GPU)
    fit._decide.cache_clear()
    with pytest.raises(FileNotFoundError, match=r"nvidia_h200.json is missing"):
        fit.plan_walk("kda_fwd_walk", (1585, 641), 32, 132, "auto")
    with pytest.raises(FileNotFoundError, match=r"nvidia_h200.json is missing"):
        fit.walk_step_us("kda_fwd_walk")


def test_a_gpu_without_a_table_runs_on_the_defaults(monkeypatch, tmp_path, caplog):
    """Another GPU: no measured costs, so walks stay full and the pipeline's walks keep their own SMs."""
    import logging
    monkeypatch.setattr(fit, "PARAMS_DIR", tmp_path)
    monkeypatch.setattr(fit, "current_gpu", lambda: "NVIDIA B200")
    fit._decide.cache_clear()
    fit.measured_rho.cache_clear()
    fit.pipelined_walk_sms.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="kda_aot.schedule.fit"):
            assert fit.plan_walk("kda_fwd_walk", (1585, 641), 32, 132, "auto") == (("full", 0, 2),)
        assert "no table for this GPU (nvidia_b200.json)" in caplog.text
        assert fit.pipeline_params() == {} and fit.walk_step_us("kda_fwd_walk") is None
        assert fit.pipelined_walk_sms("kda_fwd_walk", (3125, 779), 32, 132, 0) == 32
    finally:
        fit._decide.cache_clear()
        fit.measured_rho.cache_clear()
        fit.pipelined_walk_sms.cache_clear()


def test_pipeline_groups():
    """Up to four segments: one group each; more: four contiguous runs of about equal chunk totals;
    launch order longest walk first; one segment: no pipeline."""
    assert grouping.plan_pipeline((1585, 641, 1216, 465)) == ((0, 1), (2, 3), (1, 2), (3, 4))
    assert grouping.plan_pipeline((700,)) == ((0, 1),)
    assert grouping.plan_pipeline((1025, 193, 1563, 487, 625, 205)) == ((1, 3), (0, 1), (4, 6), (3, 4))
    groups = grouping.plan_pipeline([3] * 500)
    assert sorted(groups) == [(0, 125), (125, 250), (250, 375), (375, 500)]
    for lengths in ([5, 1, 1, 1, 1, 1, 1, 1, 9], [1] * 7, [100] + [1] * 20):
        groups = sorted(grouping.plan_pipeline(lengths))
        assert groups[0][0] == 0 and groups[-1][1] == len(lengths) and len(groups) <= grouping.PIPELINE_GROUPS
        assert all(a < b for a, b in groups) and all(x[1] == y[0] for x, y in zip(groups, groups[1:]))


def test_pipeline_groups_with_segments_first():
    """CP senders (first=): each its own group, ahead of the others, whose groups are the plain runs
    with the senders taken out; every segment in exactly one group; the last group's pieces follow."""
    assert grouping.plan_pipeline((1584, 368), (1,)) == ((1, 2), (0, 1))  # Q1 contiguous CP2, rank 0
    assert grouping.plan_pipeline((1025, 193, 1563, 487, 625, 205), (3,)) == ((3, 4), (1, 3), (0, 1), (4, 6))
    assert grouping.plan_pipeline((1025, 193, 1563, 487, 625, 205), (0, 2)) == ((0, 1), (2, 3), (4, 6), (3, 4), (1, 2))
    assert grouping.plan_pipeline((700,), (0,)) == ((0, 1),)
    assert grouping.last_group_pieces((1584, 368), (1,)) == [0, 396, 792, 1188, 1584]
    assert grouping.last_group_pieces((1584, 368)) == [1584, 1676, 1768, 1860, 1952]
    for lengths, first in (([5, 1, 1, 1, 1, 1, 1, 1, 9], (0, 4, 8)), ([1] * 7, (6,)), ([100] + [1] * 20, (3, 4))):
        groups = grouping.plan_pipeline(lengths, first)
        assert groups[:len(first)] == tuple((s, s + 1) for s in first)
        assert sorted(s for a, b in groups for s in range(a, b)) == list(range(len(lengths)))


def test_pipelined_walk_sms(monkeypatch):
    """A walk beside the chunk stage is planned on as many SMs as it has chains (full then) unless it
    stays the critical path on every SM with the rest of the chunk stage slowed beside it (then all
    SMs); the last group's on all, unless the forward walks it in pieces (one SM per chain then). The
    packs' decisions are the ones measured (forms_ab pipeline; the pieces: docs/fit_rule.md)."""
    fit.pipelined_walk_sms.cache_clear()
    # many short documents, four groups: the chains outnumber the SMs anyway
    short = tuple([20] * 400)
    assert [fit.pipelined_walk_sms("kda_fwd_walk", short, 32, 132, i) for i in range(4)] == [132] * 4
    assert fit.pipelined_walk_sms("kda_fwd_walk", short, 1, 132, 0) == 100  # 100 chains of one head
    # Q1 at 32 heads: every walk restricted, the last one too since it runs in pieces beside the others (both
    # measured faster: docs/fit_rule.md)
    q1 = (1585, 641, 1216, 465)
    assert grouping.last_group_pieces(q1) == [3442, 3558, 3674, 3790, 3907]
    assert [fit.pipelined_walk_sms("kda_fwd_walk", q1, 32, 132, i) for i in range(4)] == [32, 32, 32, 32]
    # on half the SMs (not measured: the rule's arithmetic) the forward's third walk (1,216 chunks, 465
    # after it) stays critical on all 66 beside the lean chunk stage's rest
    assert [fit.pipelined_walk_sms(p, q1, 32, 66, i) for p in ("kda_fwd_walk", "kda_bwd_walk")
            for i in range(3)] == [32, 32, 66, 32, 32, 32]
    # the replay (two walks at once, each on half the SMs): Q2's last document (1,193 chunks) starts its
    # walks while the first one's (2,344) still hold 32 SMs each: the other 34, so full (split beside
    # them was slower: docs/fit_rule.md); Q1's earlier walks are predicted done by then: every SM of the half
    q2 = (2344, 1193)
    for p in ("kda_fwd_walk", "kda_bwd_walk"):
        assert fit.pipelined_walk_sms(p, q2, 32, 66, 1, 2) == 34
        assert fit.plan_walk(p, q2[1:], 32, 34, "auto") == (("full", 0, 1),)
        assert fit.pipelined_walk_sms(p, q1, 32, 66, 3, 2) == 66
    # Q6 (200,000 + 49,856 tokens): the long document's walk, with 20 % of the chunk stage after it,
    # gets every SM (quarter CTAs, 4 x 32 <= 132; measured faster: docs/fit_rule.md)
    q6 = (3125, 779)
    assert fit.pipelined_walk_sms("kda_fwd_walk", q6, 32, 132, 0) == 132
    assert fit.pipelined_walk_sms("kda_fwd_walk", q6, 32, 132, 1) == 132  # in pieces, beside that walk
    # CP: a rank's only chain, sent and cut in pieces (pieced_group): one SM per chain, as a last group in
    # pieces (CP2 Q2 contiguous rank 0: 1,769 chunks); whole, it would get every SM
    assert fit.pipelined_walk_sms("kda_fwd_walk", (1769,), 32, 132, 0, 1, (0,), 0) == 32
    assert fit.pipelined_walk_sms("kda_fwd_walk", (1769,), 32, 132, 0, 1, (0,)) == 132
    # CP: a pieced chain that is not the rank's last group starts its walk after its first piece, with the rest
    # of the chunk stage (its own later pieces included) beside it: one SM per chain (CP1 Q6, 8 pieces of 390
    # chunks: every SM measured slower, docs/fit_rule.md), in the replay (two walks) too
    assert grouping.first_piece_chunks(3125) == 390
    assert fit.pipelined_walk_sms("kda_fwd_walk", q6, 32, 132, 0, 1, (), 0) == 32
    assert fit.pipelined_walk_sms("kda_fwd_walk", q6, 32, 66, 0, 2, (), 0) == 32
    assert fit.pipelined_walk_sms("kda_bwd_walk", q6, 32, 66, 0, 2, (), 0) == 32
    # the replay's last group beside them: the pieced chain's walks hold the 32 SMs of half's 66 this rule
    # gives them, not the 66 of an unpieced group (full either way: the launches are the same)
    assert fit.pipelined_walk_sms("kda_fwd_walk", q6, 32, 66, 1, 2, (), 0) == 34
    assert fit.pipelined_walk_sms("kda_fwd_walk", q6, 32, 66, 1, 2, ()) == 32
    # the forward's last group beside them: every earlier walk restricted (the pieced one on 32), so one SM per
    # chain too (CP1 Q6: the same launches as forced full)
    assert fit.pipelined_walk_sms("kda_fwd_walk", q6, 32, 132, 1, 1, (), 0) == 32
    fit._decide.cache_clear()
    assert fit.plan_walk("kda_fwd_walk", (3125,), 32, 132, "auto") == (("quarter", 0, 1),)
    # one long document then 200 short ones, one head: the long walk gets every SM, the short runs
    # (walks of 40 chunks beside most of the chunk stage) keep their own SMs
    tail = (3000,) + (40,) * 200
    assert grouping.plan_pipeline(tail) == ((0, 1), (1, 64), (64, 133), (133, 201))
    assert [fit.pipelined_walk_sms("kda_fwd_walk", tail, 1, 132, i) for i in range(4)] == [132, 63, 69, 132]
    # a GPU without a table: every group's walk but the last keeps its own SMs
    monkeypatch.setattr(fit, "pipeline_params", lambda: {})
    fit.pipelined_walk_sms.cache_clear()
    try:
        assert fit.pipelined_walk_sms("kda_fwd_walk", q6, 32, 132, 0) == 32
        assert fit.pipelined_walk_sms("kda_fwd_walk", q6, 32, 132, 1) == 32  # in pieces, the others restricted
        assert fit.pipelined_walk_sms("kda_fwd_walk", q6, 32, 66, 1, 2) == 66  # the replay's: whole, every SM
    finally:
        fit.pipelined_walk_sms.cache_clear()


def test_summary_pieces():
    """CP summary walks in pieces: the cut with the shortest predicted launch plus compositions;
    short fragments and launches that fill the SMs anyway stay whole."""
    fit.summary_pieces.cache_clear()
    assert fit.summary_pieces((1953,), 32, 132) == (4,)      # 128 chains; 5 pieces would be two waves
    assert fit.summary_pieces((20,), 32, 132) == (1,)        # under MIN_SUMMARY_PIECE
    assert fit.summary_pieces((1000,) * 8, 32, 132) == (1,) * 8  # 256 chains fill the SMs already
    assert fit.summary_pieces((), 32, 132) == ()
    counts = fit.summary_pieces((792, 320, 608, 232), 32, 132)  # doc_zigzag Q1, rank 1
    assert all(1 <= c <= fit.MAX_SUMMARY_PIECES for c in counts) and counts[0] > 1
    assert fit.summary_pieces((3000,), 1, 132) == (fit.MAX_SUMMARY_PIECES,)
    for n, p in ((1953, 4), (7, 3), (64, 1), (65, 2)):
        lengths = grouping.piece_lengths(n, p)
        assert sum(lengths) == n and len(lengths) == p and max(lengths) - min(lengths) <= 1


def test_pipeline_slowdown_by_walks_beside(monkeypatch):
    """The replay's walks are planned with the slowdown for two walks at once. The fitted variant
    (forms_ab's critical-tuned arm) keeps Q1 and Q6 as measured and moves Q2 to the arms that won it:
    the forward's long walk on every SM, the replay's restricted."""
    q1, q2, q6 = (1585, 641, 1216, 465), (2344, 1193), (3125, 779)
    costs = fit.pipeline_params()
    monkeypatch.setattr(fit, "pipeline_params", lambda: dict(costs, chunk_stage_slowdown_beside_walk={1: 1.7, 2: 3.4}))
    fit.pipelined_walk_sms.cache_clear()
    try:
        assert [fit.pipelined_walk_sms("kda_fwd_walk", q1, 32, 132, i) for i in range(4)] == [32, 32, 32, 32]
        assert [fit.pipelined_walk_sms("kda_fwd_walk", q1, 32, 66, i, 2) for i in range(4)] == [32, 32, 32, 66]
        assert fit.pipelined_walk_sms("kda_fwd_walk", q2, 32, 132, 0) == 132
        assert fit.pipelined_walk_sms("kda_fwd_walk", q2, 32, 66, 0, 2) == 32
        assert fit.pipelined_walk_sms("kda_fwd_walk", q6, 32, 132, 0) == 132
        assert fit.pipelined_walk_sms("kda_fwd_walk", q6, 32, 66, 0, 2) == 66
    finally:
        fit.pipelined_walk_sms.cache_clear()


def test_rewalk_beside():
    """The CP backward's second walk beside kda_bwd_chunk: one CTA per chain while that hides it."""
    fit.rewalk_beside.cache_clear()
    assert fit.rewalk_beside((1584, 368), (1,), 32, 132) == 32      # CP2 Q1 contiguous, rank 0
    assert fit.rewalk_beside((1584, 368), (0,), 32, 132) is None    # the long walk: first, every SM
    assert fit.rewalk_beside((1584, 368), (0, 1), 32, 132) is None  # nothing to run beside
    assert fit.rewalk_beside((1584, 368), (), 32, 132) is None
    assert fit.rewalk_beside(tuple([40] * 8) + (2000,), tuple(range(8)), 32, 132) is None  # 256 chains


def test_pieced_group(kda_options):
    """One GPU: the last group when it is one segment; CP: the longest chain not deferred, a sent one too
    (also alone: no other group) with Options.cp_piece_senders (off by default until measured)."""
    kda_options(cp_piece_senders=True)
    assert grouping.pieced_group((1585, 641, 1216, 465)) == (3, grouping.last_group_pieces((1585, 641, 1216, 465)))
    assert grouping.pieced_group((1584, 368), (1,), (), True) == (1, [198 * p for p in range(9)])  # CP2 Q1 rank 0
    assert grouping.pieced_group((272, 1216, 465), (), (0,), True) == (0, [272 + 152 * p for p in range(9)])  # rank 1
    assert grouping.pieced_group((272, 1216, 465), (), (1,), True)[1][:2] == [1488, 1546]
    assert grouping.pieced_group((272, 40), (1,), (0,), True) == (0, [272 + 8 * p for p in range(6)])  # the sent one
    assert grouping.pieced_group((1024, 194, 625, 205), (0,), (1,), True) == (0, [128 * p for p in range(9)])  # Q3 zigzag
    assert grouping.pieced_group((272, 20, 10), (), (0,), True) == (1, [272, 282, 292])  # 2 pieces of >= 8 chunks
    assert grouping.pieced_group((272, 10), (), (0,), True) is None  # too short to cut
    assert [grouping.lead_pieces(n) for n in (2, 3, 8)] == [1, 1, 4]
    assert grouping.pieced_group((700,), (), (), True) == (0, [700 * p // 8 for p in range(9)])  # alone (Q2 rank 0)
    assert grouping.pieced_group((700,), (0,), (), True)[0] == 0
    assert grouping.pieced_group((272, 10), (1,), (0,), True) is None  # too short to cut
    kda_options(cp_piece_senders=False)            # the default rule
    assert grouping.pieced_group((272, 40), (1,), (0,), True) is None
    assert grouping.pieced_group((700,), (), (), True) is None
    assert grouping.pieced_group((1024, 194, 625, 205), (0,), (1,), True) == (1, [1218 + 625 * p // 8 for p in range(9)])


def test_the_gate_floor_is_the_kernels():
    """kda_aot.schedule.kda.GATE_FLOOR (the initial state's factor) is -kGateFloor of templates/common/kda.h."""
    import re
    from codegen import ROOT
    from kda_aot.schedule.kda import GATE_FLOOR
    text = (ROOT / "templates" / "common" / "kda.h").read_text()
    assert float(re.search(r"constexpr float kGateFloor = ([0-9.]+)f;", text).group(1)) == -GATE_FLOOR


def test_summary_pieces_cost_comes_from_the_gpu_table(monkeypatch, tmp_path):
    """The cost of an extra summary piece is the GPU table's pipeline.compose_steps_per_piece: a costly
    composition keeps a fragment whole, a free one cuts it as far as the SMs allow."""
    # the H200 table's own entry (without a GPU the fit rule reads that table too), not the default for a GPU without one
    assert fit._table(fit.params_file(fit.MEASURED_GPU))["pipeline"]["compose_steps_per_piece"] == 3.0
    assert fit.compose_steps_per_piece() == 3.0
    for cost, want in ((1e6, (1,)), (0.0, None)):
        params = tmp_path / f"fit_params_{cost}.json"
        params.write_text(f'{{"programs": {{}}, "pipeline": {{"compose_steps_per_piece": {cost}}}}}')
        monkeypatch.setattr(fit, "PARAMS_FILE", params)
        fit.summary_pieces.cache_clear()
        got = fit.summary_pieces((1953,), 32, 132)
        assert got == want if want else got[0] >= 4, (cost, got)
    fit.summary_pieces.cache_clear()
