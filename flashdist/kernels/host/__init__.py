"""Host-side helpers in C++, built at first use as the fused CPU step is (``flashdist.kernels.cpu``: the same
cache folder scheme, lock and compiler flags), from ``addresses.cpp`` beside this file.

``addresses_changed(tensors, grads, seen)``: whether the storage address of any tensor of a list (or of its
``.grad``) differs from the int64 CPU tensor ``seen``, which it updates; a few nanoseconds per tensor where
Python spends a few hundred. ``flashdist.GraphedStep`` checks every call with it.
``grad_info(params, addresses, dtypes, numels)``: the address, dtype number and numel of each parameter's
gradient, written into int64 CPU tensors, if every gradient exists, is contiguous and is on its parameter's
device (else False): what ``GraphedStep`` points a captured step's tables at before each replay. ``load()`` returns None
(after one warning) where it cannot be built; the callers then do the same in Python.
"""

from __future__ import annotations

from pathlib import Path

from ..cpu import BuiltOnce

SOURCE = Path(__file__).with_name("addresses.cpp")
_HELPERS = BuiltOnce(SOURCE, "the host helpers", "GraphedStep checks addresses in Python (slower). Install g++ "
                     "and ninja to build them.")


def load():
    """The compiled helpers, building them on first use; None (after one warning) where they cannot be built."""
    return _HELPERS.load()
