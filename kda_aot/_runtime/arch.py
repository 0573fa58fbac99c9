"""GPU compute capability -> the arch our records are rendered for. Torch-free: setup.py reads it too."""
CAPABILITY_ARCH = {(9, 0): "sm_90a"}
DEFAULT_ARCH = "sm_90a"  # without a GPU to ask: what setup.py builds and the registry loads


def arch_of(capability) -> str:
    """The arch for a (major, minor) capability: ours where we render one, else the plain sm_XY."""
    major, minor = (int(x) for x in capability)
    return CAPABILITY_ARCH.get((major, minor), f"sm_{major}{minor}")
