"""Worker side of tests/test_cp_gloo.py: one spawned process per rank runs a list of cases.

Process start-up (importing torch) dominates on a small CI machine, so each job spawns W
processes once and runs every case of that world size in them. The parent prepares all inputs
(global tensors) and the expected single-device results; the workers only run the CP code on
their shards and hand their LOCAL results back through one file per rank, which the parent
assembles with the plan (unshard) and checks. Not a test module (no test_ prefix).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import deterministic_mode
from kda_aot import cp, options, reference
from kda_aot.nn import PackedKDA


# ----------------------------------------------------------------------------- parent side

def run_job(world_size: int, cases: list, workdir: str, timeout_s: float,
            collective_timeout_s: float = 60.0, device: str = "cpu") -> list:
    """Spawn `world_size` ranks (FileStore: no network port) that run `cases`; return the
    per-rank result lists. device "cpu": gloo; "cuda": NCCL, rank r on GPU r, inputs moved
    there and results moved back; "cuda-shared": every rank on GPU 0, gloo between them (NCCL
    refuses two ranks on one GPU) with the package's one collective staged through host memory
    (_staged_gather). Raises if the job does not finish within timeout_s (the
    processes are then killed: a hang fails the test instead of blocking CI)."""
    os.makedirs(workdir, exist_ok=True)
    cases_path = os.path.join(workdir, "cases.pt")
    torch.save(cases, cases_path)
    store = os.path.join(workdir, "store")
    ctx = mp.start_processes(_worker, args=(world_size, store, cases_path, workdir,
                                            collective_timeout_s, device),
                             nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"CP job with {world_size} ranks did not finish in {timeout_s} s")
    finally:
        for p in ctx.processes:            # only the processes this job started
            if p.is_alive():
                p.kill()
                p.join()
    return [torch.load(os.path.join(workdir, f"rank{r}.pt"), weights_only=False)
            for r in range(world_size)]


# ----------------------------------------------------------------------------- worker side

def _to(obj, device):
    """Tensors inside nested dicts/lists/tuples moved to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, device) for v in obj)
    return obj


def _staged_gather(gather_flat):
    """kda_aot.cp.exchange.gather_flat through host memory: every collective of the package is this one
    all_gather, and gloo's support of CUDA tensors in it depends on the torch build. What the kernels
    compute is unchanged; only the transport between the ranks differs from NCCL's."""
    def staged(mine, world, group):
        return gather_flat(mine.cpu(), world, group).to(mine.device)
    return staged


def _worker(rank, world_size, store, cases_path, workdir, collective_timeout_s, device="cpu"):
    torch.set_num_threads(1)     # W processes share a couple of cores
    nccl = device == "cuda"
    if nccl:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    elif device == "cuda-shared":
        from kda_aot.cp import exchange
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        exchange.gather_flat = _staged_gather(exchange.gather_flat)
    dist.init_process_group("nccl" if nccl else "gloo",
                            store=dist.FileStore(store, world_size), rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=collective_timeout_s))
    cases = _to(torch.load(cases_path, weights_only=False), device)
    results = {}
    # On a GPU every allocation starts as NaN, as in the single-process GPU tests (conftest.nan_filled_memory):
    # a row the CP code leaves unwritten cannot pass as stale finite memory.
    poisoned = contextlib.nullcontext() if device == "cpu" else deterministic_mode(True, warn_only=True)
    with poisoned:
        failed = _run_cases(rank, cases, results)
    torch.save(results, os.path.join(workdir, f"rank{rank}.pt"))
    if not failed:
        dist.destroy_process_group()


def _run_cases(rank, cases, results) -> bool:
    """Each case into results[name]; True after a failure (the rest not run)."""
    for case in cases:
        t0 = time.perf_counter()
        try:
            with options.using(**case.get("options", {})):  # this case's Options alone
                results[case["name"]] = _to(RUNNERS[case["kind"]](rank, case), "cpu")
            results[case["name"]]["seconds"] = time.perf_counter() - t0
        except Exception:
            # After an unexpected error the ranks may be out of step in their collectives:
            # stop here (the others time out in their next collective and stop too).
            results[case["name"]] = {"error": f"rank {rank}: {traceback.format_exc()}"}
            return True
    return False


def _leaf(x):
    return x.detach().clone().requires_grad_(True)


def _run_op(rank, case):
    """chunk_kda_cp on the shards, both backward modes; loss = <o, wo> + <final, ws>. The case's
    backend: the fp32/fp64 reference (default) or "cuda" (the kernels; head dim 128)."""
    plan = cp.make_plan(case["cu"], case["layout"], group=dist.group.WORLD)
    x = case["inputs"]
    backend = cp.get_backend(case.get("backend", "reference"), case["state_dtype"])
    out = {}
    fla = case.get("fla")  # FLA's activations: {"lower_bound": ..., "allow_neg_eigval": ...}; A_log, dt_bias in x
    for mode in case["modes"]:
        loc = [_leaf(plan.shard(x[n])) for n in ("q", "k", "v", "g", "beta")]
        h0 = _leaf(x["h0"])
        extra, params = {}, {}
        if fla is not None:
            params = {n: _leaf(x[n]) for n in ("A_log", "dt_bias")}
            extra = dict(fla, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, **params)
        o, s = cp.chunk_kda_cp(*loc, plan=plan, initial_state=h0, output_final_state=True,
                               backward=mode, backend=backend, **extra)
        loss = (o * plan.shard(x["wo"])).sum() + (s * x["ws"]).sum()
        loss.backward()
        out[mode] = {"o": o.detach(), "final": s.detach(), "dh0": h0.grad,
                     **{"d" + n: t.grad for n, t in zip(("q", "k", "v", "g", "beta"), loc)},
                     **{"d" + n: t.grad for n, t in params.items()}}
    out["gathered_o"] = cp.gather(out[case["modes"][0]]["o"], plan)
    return out


def _run_module(rank, case):
    """PackedKDA (conv + halo + L2 norm + CP KDA) on the shards, both backward modes."""
    plan = cp.make_plan(case["cu"], case["layout"], group=dist.group.WORLD)
    x = case["inputs"]
    out = {}
    for mode in case["modes"]:
        m = PackedKDA(case["H"], case["head_dim"], conv_bias=True, backward=mode,
                      backend=case.get("backend", "reference"))
        m.load_state_dict(case["state_dict"])
        m.to(x["q"].device)
        loc = [_leaf(plan.shard(x[n])) for n in ("q", "k", "v", "g", "beta")]
        o, _ = m(*loc, plan=plan)
        (o * plan.shard(x["wo"])).sum().backward()
        out[mode] = {"o": o.detach(),
                     **{"d" + n: t.grad for n, t in zip(("q", "k", "v", "g", "beta"), loc)},
                     **{"d" + n: p.grad for n, p in m.named_parameters()}}
    return out


def _run_conv(rank, case):
    """The CP conv on the shard; loss = <y, wy>. A rank holding no token has no segment to
    convolve: conv1d_silu_cp keeps its halo in the graph so that its collective backward runs."""
    plan = cp.make_plan(case["cu"], case["layout"], group=dist.group.WORLD)
    x = case["inputs"]
    xl, w, b = _leaf(plan.shard(x["x"])), _leaf(x["w"]), _leaf(x["b"])
    y = cp.conv1d_silu_cp(xl, w, b, plan=plan)
    (y * plan.shard(x["wy"])).sum().backward()
    out = {"y": y.detach(), "dx": xl.grad, "dw": w.grad, "db": b.grad}
    # The plain formula (reference conv on the local segments with the exchanged halo).
    halo = cp.conv_halo(xl.detach(), plan)
    out["halo"] = halo
    if plan.local_fragments:
        y2 = reference.conv1d_silu(xl.detach(), w.detach(), b.detach(),
                                   cu_seqlens=plan.local_cu_seqlens, halo=halo, dtype=xl.dtype)
        out["y_formula_equal"] = torch.equal(y2, out["y"])
    return out


def _run_error(rank, case):
    """Ranks that disagree: every rank must raise (no hang), then the group must still work."""
    variant, W = case["variant"], dist.get_world_size()
    cu, T = list(case["cu"]), case["cu"][-1]
    layout = "contiguous"
    if variant == "cu_seqlens" and rank == 1:
        cu = [0, T // 2, T]                    # same T, other documents
    if variant == "layout" and rank == W - 1:
        layout = "zigzag"
    if variant == "world_size" and rank == 0:
        plan = cp.make_plan(cu, layout, world_size=W + 1, rank=0)
    elif variant == "wrong_rank":
        plan = cp.make_plan(cu, layout, world_size=W, rank=(rank + 1) % W)
    else:
        plan = cp.make_plan(cu, layout, group=dist.group.WORLD)
    H, K = 2, 8
    if variant == "heads" and rank == 0:
        H = 3
    n = plan.num_local_tokens - (1 if variant == "local_shape" and rank == W - 1 else 0)
    dev = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    q = torch.randn(1, n, H, K, device=dev)
    got = None
    try:
        if variant == "halo_layout":
            if rank == 0:
                plan = cp.make_plan(cu, "zigzag", group=dist.group.WORLD)
            cp.conv_halo(torch.randn(1, plan.num_local_tokens, 8, device=dev), plan)
        elif variant in ("module_local_shape", "module_heads", "module_beta"):
            # PackedKDA's one agreement check for its whole call (conv facts and KDA facts together)
            from kda_aot.nn import PackedKDA
            Hm = 3 if variant == "module_heads" and rank == 0 else H
            m = PackedKDA(Hm, K).to(dev)
            nm = plan.num_local_tokens - (1 if variant == "module_local_shape" and rank == W - 1 else 0)
            x = torch.randn(1, nm, Hm * K, device=dev)
            nb = nm - (1 if variant == "module_beta" and rank == W - 1 else 0)
            m(x, x, x, -torch.rand(1, nm, Hm, K, device=dev), torch.rand(1, nb, Hm, device=dev), plan=plan)
        else:
            k = q[:, 1:] if variant == "k_shape" and rank == W - 1 else q
            cp.chunk_kda_cp(q, k, q, -q.abs(), torch.rand(1, n, H, device=dev), plan=plan)
    except Exception as e:  # noqa: BLE001 - the test checks the type
        got = (type(e).__name__, str(e))
    # The group must still be in step: a plain collective afterwards completes.
    t = torch.tensor([rank], dtype=torch.int64, device=dev)
    dist.all_reduce(t)
    return {"raised": got, "after": int(t)}


def _run_compiled(rank, case):
    """A CP training step under torch.compile(fullgraph=True, backend=case["compiler"]) against eager:
    chunk_kda_cp alone and PackedKDA (conv + halo + KDA), both backward modes, output and every gradient
    bitwise. Returns {"bitwise": {what: bool}}."""
    import torch._dynamo
    plan = cp.make_plan(case["cu"], case["layout"], group=dist.group.WORLD)
    x, (xm, sd) = case["inputs"], case["module_inputs"]

    def op_step(q, k, v, g, beta, h0, wo, ws, mode):
        o, s = cp.chunk_kda_cp(q, k, v, g, beta, plan=plan, initial_state=h0, output_final_state=True, backward=mode)
        return (o * wo).sum() + (s * ws).sum(), o

    def module_step(m, q, k, v, g, beta, wo):
        o, _ = m(q, k, v, g, beta, plan=plan)
        return (o * wo).sum(), o

    def run(step, leaves, *rest):
        for t in leaves:
            t.grad = None
        loss, o = step(*leaves, *rest)
        loss.backward()
        return [o.detach().clone()] + [t.grad.clone() for t in leaves]

    out = {}
    for mode in ("replay", "saved"):
        torch._dynamo.reset()
        leaves = [_leaf(plan.shard(x[n])) for n in ("q", "k", "v", "g", "beta")] + [_leaf(x["h0"])]
        rest = (plan.shard(x["wo"]), x["ws"], mode)
        compiled = torch.compile(op_step, fullgraph=True, backend=case["compiler"])
        eager = run(op_step, leaves, *rest)
        got = run(compiled, leaves, *rest)
        out[f"op/{mode}"] = all(torch.equal(a, b) for a, b in zip(eager, got))
        m = PackedKDA(case["H"], case["head_dim"], conv_bias=True, backward=mode)
        m.load_state_dict(sd)
        loc = [_leaf(plan.shard(xm[n])) for n in ("q", "k", "v", "g", "beta")]
        params = list(m.parameters())
        wo = plan.shard(xm["wo"])

        def mstep(*ts):
            return module_step(m, *ts[:5], wo)
        eager, got = [], []
        for fn, into in ((mstep, eager), (torch.compile(mstep, fullgraph=True, backend=case["compiler"]), got)):
            for t in loc + params:
                t.grad = None
            loss, o = fn(*loc)
            loss.backward()
            into += [o.detach().clone()] + [t.grad.clone() for t in loc + params]
        out[f"module/{mode}"] = all(torch.equal(a, b) for a, b in zip(eager, got))
    return {"bitwise": out}


RUNNERS = {"op": _run_op, "module": _run_module, "conv": _run_conv, "error": _run_error, "compiled": _run_compiled}
