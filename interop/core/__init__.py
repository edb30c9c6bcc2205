"""The contract core: the op's configuration, its validation and its NumPy reference.

The bottom floor of fusedkv: it imports NumPy and ml_dtypes only (and safetensors, when
``checkpoint`` reads a checkpoint), never a backend, a framework, a test helper or a tool. Both backends build on it; interop's neutral call,
``fusedkv check``, ``fusedkv bench`` and the testing helpers build on the backends.
"""
