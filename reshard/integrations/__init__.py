"""Integrations with the frameworks that own the user's workers: ``ray_train`` (a Ray Train worker
group as one device mesh, weight syncs called by every rank). Pure until used: ``from
reshard.integrations import ray_train`` loads its runtime module (``reshard.runtime.integrations``)
on first use, inside the train function."""

from __future__ import annotations

import importlib
import sys

MODULES = ("ray_train",)


def __getattr__(name: str):
    if name not in MODULES:
        raise AttributeError(f"module 'reshard.integrations' has no attribute {name!r}")
    module = importlib.import_module(f"reshard.runtime.integrations.{name}")
    sys.modules[f"{__name__}.{name}"] = module  # ``import reshard.integrations.ray_train`` after this finds it too
    return module


__all__ = list(MODULES)
