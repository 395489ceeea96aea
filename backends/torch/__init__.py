"""PyTorch kernels for the h2ir op set (CPU, and CUDA by the same code)."""
from backends.torch.runtime import TorchBackend

__all__ = ["TorchBackend"]
