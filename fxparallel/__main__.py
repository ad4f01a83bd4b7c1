"""``python -m fxparallel``: the command line (see fxparallel/cli.py)."""
import sys

from .cli import main

sys.exit(main())
