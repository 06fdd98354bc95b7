"""`no_host_reads()`: a context in which reading a tensor's values on the host raises.

On a GPU each such read (`.item()`, `.tolist()`, `bool(t)`, `int(t)`, `float(t)`) is
a device-to-host sync that stalls the stream. On the CPU nothing stalls, so the tests
catch the reads themselves: an op called with `validate=False` must do none of them.
(`nonzero` is not caught: the reference path compacts rows with it, which is no sync
on the CPU tensors it serves.)
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

# Tensor methods that hand values (or a value-dependent shape) to Python.
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


class HostRead(AssertionError):
    pass


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def refuse(name):
        def method(self, *args, **kwargs):
            raise HostRead(f"Tensor.{name} read values on the host (a device sync on a GPU)")

        return method

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, refuse(name))
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
