"""kda_aot: ahead-of-time compiled training kernels for Kimi Delta Attention on packed documents."""
from . import reference, registry
from .conv import causal_conv1d_silu

__all__ = ["causal_conv1d_silu", "reference", "registry"]
from . import cp, nn  # noqa: E402  (context parallelism, PackedKDA)
