"""How the KDA kernels are launched: the fit rule (fit: which walk form and order each launch takes,
from measured per-GPU costs) and the launch sequences over the pack (kda: the chunk stage, the state
walks, the pipelined orders, the backward stages)."""
