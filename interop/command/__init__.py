"""The ``fusedkv`` command line: ``cli.py`` (the entry point), ``check.py`` (``fusedkv
check``: every backend against the reference and each other), ``backends.py`` (the
kernels as the check runs them). ``fusedkv bench`` lives in :mod:`interop.bench`."""
