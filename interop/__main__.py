import sys

from interop.command.cli import main

sys.exit(main())
