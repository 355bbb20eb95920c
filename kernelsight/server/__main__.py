"""``python -m kernelsight.server [serve flags]``: the server without going through the main CLI."""

import sys

from kernelsight.server.cli import main

sys.exit(main())
