"""``python -m kernelsight.server [serve flags]`` is ``kernelsight serve [serve flags]``."""

import sys

from kernelsight.cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
