"""kda_aot: ahead-of-time compiled training kernels for Kimi Delta Attention on packed documents."""
from . import cp, nn, reference
from ._runtime import registry
from ._lib import VERSION as __version__  # e.g. 0.1.0+sm90a: the arch its kernels were built for
from .ops.conv import causal_conv1d_silu
from .ops.chunk_kda import chunk_kda
from .nn import PackedKDA

__all__ = ["PackedKDA", "causal_conv1d_silu", "chunk_kda", "cp", "nn", "reference", "registry"]
