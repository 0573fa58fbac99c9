"""The ops training code calls, one module per family, each a torch.library custom op with its fake
and autograd: chunk_kda (packed KDA forward and backward), conv (causal conv1d + SiLU), norm (the
per-head L2 norm)."""
