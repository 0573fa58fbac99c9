"""The records' extension modules, and build_info: the version and arch setup.py built them for."""
try:
    from .build_info import ARCH, VERSION
except ImportError:  # a source checkout where nothing is built yet
    ARCH = VERSION = "source"
