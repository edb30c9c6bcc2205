"""fusedkv for JAX: the Pallas GPU kernel, its jit-native wrapper, the materializer."""
