"""fusedkv for PyTorch: the Triton kernel, its torch.library registration, the materializer."""
