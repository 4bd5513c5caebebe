"""The passes (pure): lowering a plan to per-device programs, pulls inside shared-memory domains,
bucket packing, sequencing, validation, and ``compile``, which runs them in that order."""
