"""What the stand-in packages in this folder share: names that import but do not run.

A stand-in package (``sgl_kernel``, ``torchvision``) calls ``stand_in(__name__)``:
then every attribute it does not define, and every submodule under it
(``sgl_kernel.kvcacheio``, ``torchvision.transforms.functional``...), imports
as an ``Unavailable`` placeholder. A placeholder can be read, compared and
used as a default argument (``InterpolationMode.BICUBIC``), so modules that
import such names at their top level load; *calling* one raises
``NotImplementedError`` naming it. SGLang code that reaches a real kernel or
a real image transform therefore fails loudly (in SGLang's scheduler process,
which then takes the engine down: the test fails) instead of computing
something else.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class Unavailable:
    """A name of a stand-in package that is importable but not implemented."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{self._name} is not implemented by sart's test stand-in "
            f"(tests/shims/{self._name.split('.')[0]}): this code path needs the real package"
        )

    def __getattr__(self, attr: str) -> Unavailable:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Unavailable(f"{self._name}.{attr}")

    def __repr__(self) -> str:
        return f"<unavailable {self._name}>"


def _module_getattr(module_name: str) -> Any:
    def __getattr__(attr: str) -> Unavailable:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Unavailable(f"{module_name}.{attr}")

    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every not-found submodule of the stand-in packages as a placeholder module."""

    def __init__(self) -> None:
        self.packages: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.split(".", 1)[0] not in self.packages or "." not in fullname:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []  # a package: its own submodules import too
        module.__getattr__ = _module_getattr(spec.name)  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


_FINDER = _Finder()


def stand_in(package: str) -> Any:
    """Make ``package``'s missing attributes and submodules placeholders; returns the
    module-level ``__getattr__`` for the package to install."""
    _FINDER.packages.add(package)
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)  # after the path finders: real files win
    return _module_getattr(package)
