"""Benchmark packs (a copy of the design brief's packs.json, which does not travel to the GPU machine)."""
PACKS = {
    "Q1": [101377, 40961, 77777, 29741],
    "Q2": [150001, 76335],
    "Q3": [65537, 12289, 99999, 31111, 40000, 13112],
    "Q4": [120000, 80161, 39999],
    "Q5": [51001, 51003, 51005, 51999, 50000],
    "Q6": [200000, 49856],
}
HEADS_DEFAULT = 32
HEAD_DIM = 128
