"""Embedding compression methods behind the physical-table interface (see compression/base.py).

To add a method: write one file with an `EmbeddingMethod` subclass and register it in
`compression/registry.py`.

Why this file is so thin: Python 3.14 ships a stdlib package called `compression` (PEP 784) and JAX probes
`from compression import zstd` at import time on every Python. So this package (1) imports nothing heavy
on import -- names load lazily below, and the probe gets a clean ImportError on Python < 3.14 -- and
(2) where the stdlib package exists, appends it to `__path__`, so `compression.zstd` and friends still resolve.
On 3.14, run from the repository root (as the README does) so that this package is found before the stdlib's; a
rename (e.g. `recjax_compression`) would remove the caveat.
"""

import importlib
import pathlib
import sysconfig

_stdlib_compression = pathlib.Path(sysconfig.get_paths()["stdlib"]) / "compression"
if _stdlib_compression.is_dir():
    __path__.append(str(_stdlib_compression))  # noqa: F821 (package __path__)

_LAZY = {
    "EmbeddingMethod": "compression.base",
    "PhysicalTable": "compression.base",
    "TableSpec": "compression.base",
    "METHODS": "compression.registry",
    "build_method": "compression.registry",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'compression' has no attribute '{name}'")


__all__ = list(_LAZY)
