"""How the KDA kernels are launched: the fit rule (fit: which walk form and order each launch takes,
from measured per-GPU costs), the cut of a pack into segment groups and pieces (grouping), the launch
plans of the pipelined orders (plan: nodes, cached; execute: the one executor that runs them) and the
launch sequences over the pack (kda: the chunk stage, the state walks; backward: the backward stages)."""
