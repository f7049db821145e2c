"""``python -m runloop_proxy``: the command line (cli.py)."""

import sys

from .cli import main

sys.exit(main())
