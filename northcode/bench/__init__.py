"""Benchmarks (`northcode bench ...`): decode throughput of the megakernel and the PyTorch path."""
