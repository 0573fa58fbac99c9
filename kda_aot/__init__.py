"""kda_aot: ahead-of-time compiled training kernels for Kimi Delta Attention on packed documents."""
from . import cp, nn, reference, registry
from .conv import causal_conv1d_silu
from .chunk import chunk_kda

__all__ = ["causal_conv1d_silu", "chunk_kda", "cp", "nn", "reference", "registry"]
