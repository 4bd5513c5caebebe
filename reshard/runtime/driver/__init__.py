"""The driver side: what a controlling process (the driver, or any Ray task or actor holding a mesh
handle) runs. ``mesh`` (``DeviceMesh``, placed on nodes by ``node_placement``), ``tensor``
(``ShardedTensor``), ``loading`` (distribute, adopt), ``resharding`` (reshard of one tensor or a
tree), ``work`` (reshards in flight), ``controller`` (this process's ``Runtime``, which every mesh
holds) with its parts: ``device_registry`` (devices, meshes, ids, session), ``dispatch`` (ordered
calls, waiting, failures into one error), ``communicators`` (live groups over ``group_table``:
admission, rendezvous, drops), ``batches`` (the one cache of compiled calls, ``program_cache``
mirrors of the devices' caches, a batch's submission, finish and cleanup), ``holds`` and
``planning_clusters`` (the cost model); ``probe`` measures link figures.

It imports the device side only to create and attach device actors, and never runs a program."""
