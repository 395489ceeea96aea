"""A NumPy-only op library for the h2ir op set: an independent second vendor (no torch import)."""
from backends.numpy.runtime import NumpyBackend

__all__ = ["NumpyBackend"]
