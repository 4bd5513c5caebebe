"""The intermediate representation (pure): placements and layouts, region math, unit tasks, the
plan (what moves where), per-device programs and batches of them, what a backend's devices are
compiled for, transfer costs, and the msgpack encoding of it all. Imports nothing of the passes,
the planner or the runtime."""
