"""Any Ray actor as a device, as it is: calls through Ray's ``__ray_call__``.

Frameworks make their own workers (Ray Train, vLLM, verl), so their classes cannot mix in
``DeviceRole``. Ray runs a function on any actor with ``actor.__ray_call__.remote(fn, *args)``
(``fn(instance, *args)``); ``CallProxy`` wraps an actor handle so that each ``reshard_*`` call
runs ``DeviceRole``'s method of that name on the actor's instance, whose device context lives in an
attribute of its own. The calls queue behind the actor's own work, as the framework's RPCs do (a
single-threaded actor serves a stats call or an abort after a running reshard).
"""

from __future__ import annotations


class CallProxy:
    """An actor handle whose ``reshard_*`` methods run ``DeviceRole``'s on the actor (module docstring)."""

    def __init__(self, handle):
        self.handle = handle

    def __getattr__(self, name: str):
        if not name.startswith("reshard_"):
            raise AttributeError(name)
        return _Method(self.handle, name)

    def __repr__(self) -> str:
        return f"CallProxy({self.handle!r})"

    def __reduce__(self):
        return CallProxy, (self.handle,)


class _Method:
    __slots__ = ("handle", "name")

    def __init__(self, handle, name: str):
        self.handle = handle
        self.name = name

    def remote(self, *args, **kwargs):
        return self.handle.__ray_call__.remote(_invoke, self.name, *args, **kwargs)


def _invoke(instance, name: str, *args, **kwargs):
    """Run on the actor: ``DeviceRole.<name>`` with the actor's instance as ``self``."""
    from reshard.runtime.device.actor import DeviceRole

    return getattr(DeviceRole, name)(instance, *args, **kwargs)
