"""``python -m zerograph``: the ``zerograph`` command line (``zerograph.cli``)."""
from .cli import main

raise SystemExit(main())
