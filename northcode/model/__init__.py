"""The model and its files: checkpoint I/O, the synthetic checkpoints, the tokenizer, the reference PyTorch model."""
