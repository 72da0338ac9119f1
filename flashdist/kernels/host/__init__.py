"""Host-side helpers in C++, built at first use as the fused CPU step is (``flashdist.kernels.cpu``: the same
cache folder scheme, lock and compiler flags), from ``addresses.cpp`` beside this file.

``addresses_changed(tensors, grads, seen)``: whether the storage address of any tensor of a list (or of its
``.grad``) differs from the int64 CPU tensor ``seen``, which it updates; a few nanoseconds per tensor where
Python spends a few hundred. ``flashdist.GraphedStep`` checks every call with it. ``load()`` returns None
(after one warning) where it cannot be built; the callers then do the same in Python.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

SOURCE = Path(__file__).with_name("addresses.cpp")

_lock = threading.Lock()
_module = None
_failed: str | None = None


def load():
    """The compiled helpers, building them on first use; None (after one warning) where they cannot be built."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _module is None and _failed is None:
            from .. import cpu

            try:
                _module = cpu._build(SOURCE)
            except Exception as e:  # no compiler, no ninja: the Python check does the same, slower
                _failed = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
                warnings.warn(f"flashdist: the host helpers could not be built ({_failed}); GraphedStep checks "
                              "addresses in Python (slower). Install g++ and ninja to build them.", RuntimeWarning,
                              stacklevel=3)
    return _module
