"""The driver side: what a controlling process (the driver, or any Ray task or actor holding a mesh
handle) runs. ``mesh`` (``DeviceMesh``, placed on nodes by ``node_placement``), ``tensor``
(``ShardedTensor``), ``loading`` (distribute, adopt), ``resharding`` (reshard of one tensor or a
tree), ``work`` (reshards in flight), ``controller`` (this process's ``Runtime``: ordered calls,
holds, the cost model) with ``device_registry`` (devices, meshes, ids, session), ``group_table``
(live communicator groups), ``program_cache`` (the mirror of the devices' program caches),
``dispatch`` (waiting and failure classification) and ``probe`` (measured link figures).

It imports the device side only to create and attach device actors, and never runs a program."""
