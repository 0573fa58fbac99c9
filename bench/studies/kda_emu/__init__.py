"""The KDA kernels' and FLA 0.6.0's rounding points emulated in torch (CPU): the rounding model
(rounding), the knobs (knobs), inputs and the fp64 truth (inputs), the kernels' forward and backward
(forward, backward), FLA (fla). The CLI is bench/studies/kda_emulation.py."""
