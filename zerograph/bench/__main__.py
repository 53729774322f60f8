"""``python -m zerograph.bench``: the same as ``zerograph bench``."""
import sys

from .cli import main

if __name__ == "__main__":  # importing this module (e.g. to check the imports) runs nothing
    sys.exit(main())
