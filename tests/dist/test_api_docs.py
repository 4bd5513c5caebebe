"""Every exported class and function says what it does in its docstring: the API reference
(``make docs``) is generated from them."""

from __future__ import annotations

import importlib
import inspect

import pytest

pytestmark = pytest.mark.dist

PACKAGES = ("reshard", "reshard.runtime", "scheduler", "topology")


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_class_and_function_has_a_docstring_of_its_own(package):
    module = importlib.import_module(package)
    thin = {}
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            doc = inspect.getdoc(obj) or ""
            if len(doc) < 40 or "(module docstring)" in doc:
                thin[name] = doc
    assert not thin, f"{package}: document these in their docstrings (what, arguments, raises): {thin}"
