"""Names of the methods the local suite measures, and the version of its results JSON (pure).

Shared by ``bench.local`` (which runs them) and ``bench.report`` (which renders them).
"""

OURS, OURS_GLOO = "ours", "ours_gloo"
OURS_POOLED, OURS_GLOO_POOLED = "ours_pooled", "ours_gloo_pooled"
OBJECT_STORE, RDT, DTENSOR = "object_store", "rdt", "dtensor"
PEERS = (OBJECT_STORE, RDT, DTENSOR)
NAIVE = "naive"
MEMCPY, CEILING, CEILING_FRESH = "memcpy", "raw_gloo", "raw_gloo_fresh"
RTT = "empty_rtt"
SCHEMA = 2
