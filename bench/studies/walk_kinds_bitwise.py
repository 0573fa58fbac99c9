"""Are the walk records of different product kinds bitwise equal to each other? (Which kinds may be
mixed across the fit rule's forms: saved and replay gradients must stay bitwise equal whatever form
each launch picks.) Forward walk: KDA_AOT_WALK_MMA wgmma / vsplit / sync x full / split / quarter;
backward walk: KDA_AOT_BWD_WALK_MMA sync / wgmma x the forms. Prints the groups of equal records.

  python bench/studies/walk_kinds_bitwise.py
"""
import os

import torch
import torch.nn.functional as F

from kda_aot.kda import chunk_kda_bwd_walk, chunk_kda_fwd


def groups(results: dict) -> list:
    out = []
    for name, val in results.items():
        for grp in out:
            ref = results[grp[0]]
            if all(torch.equal(a, b) for a, b in zip(ref, val)):
                grp.append(name)
                break
        else:
            out.append([name])
    return out


def main():
    torch.manual_seed(0)
    lens, H = [700, 300, 129, 1, 63, 65], 4
    T = sum(lens)
    q = F.normalize(torch.randn(1, T, H, 128, device="cuda"), dim=-1).bfloat16()
    k = F.normalize(torch.randn(1, T, H, 128, device="cuda"), dim=-1).bfloat16()
    v = torch.randn(1, T, H, 128, device="cuda").bfloat16()
    g = -5 * torch.rand(1, T, H, 128, device="cuda")
    beta = torch.rand(1, T, H, device="cuda").bfloat16()
    cu = torch.tensor([0] + lens).cumsum(0).int().cuda()
    h0 = 0.1 * torch.randn(len(lens), H, 128, 128, device="cuda")
    do = torch.randn_like(q)
    fwd, bwd, saved = {}, {}, None
    for mma in ("wgmma", "vsplit", "sync"):
        os.environ["KDA_AOT_WALK_MMA"] = mma
        for form in ("full", "split", "quarter"):
            o, ht, s = chunk_kda_fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                                     save_tape=True, tape_form=form)
            fwd[f"{mma}/{form}"] = (o, ht, s["tape"], s["vnew"])
            saved = saved or s
    os.environ["KDA_AOT_WALK_MMA"] = "wgmma"
    for mma in ("sync", "wgmma"):
        os.environ["KDA_AOT_BWD_WALK_MMA"] = mma
        for form in ("full", "split", "quarter"):
            bwd[f"{mma}/{form}"] = chunk_kda_bwd_walk(saved, do, tape_form=form)
    print("forward walk, bitwise-equal groups:", groups(fwd))
    print("backward walk, bitwise-equal groups:", groups(bwd))


if __name__ == "__main__":
    main()
