"""``python -m zerograph.bench``: the same as ``zerograph bench``."""
import sys

from .cli import main

sys.exit(main())
