"""``python -m zerocc plan ...``: see ``zerocc/cli.py``."""
import sys

from .cli import main

sys.exit(main())
