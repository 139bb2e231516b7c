"""The PyTorch backend: paged prefill and decode in plain PyTorch (CUDA graphs on a GPU), and its kernel counter."""
