"""Entry point of ``python -m portable_loader.precache`` (a package, so ``-m`` never runs it twice)."""

import sys

from portable_loader.precache.cli import main

sys.exit(main())
