"""``python -m interop.bench``: the same as ``fusedkv bench``."""

import sys

from interop.command.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
