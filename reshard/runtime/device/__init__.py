"""The device side: what runs inside a device actor. ``actor`` (the RPC surface, ``DeviceRole``,
and the actor class) with ``attach`` (a user's actor made a device), ``context`` (the user's
``DeviceContext``), ``inbox`` (a controller's ordered calls, in order), ``shards`` (the device's
memory) with ``shared_memory`` (shards peers pull from), ``group_cache`` (its communicators),
``binding`` (a run's buffers: where destinations and relays land) and ``batches`` / ``executor``
(the interpreter of a device's batch program).

It never imports the driver side: a device does what the controller's messages say."""
