"""The runtime under the ops: the registry of compiled libraries ((program, form) -> library, checked
against build.json), the torch-free tensor descriptors of the binding ABI (tensor), and the pack's
chunk and segment tables (packing)."""
