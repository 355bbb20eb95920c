"""``python -m kernelsight.server [serve flags]`` is ``kernelsight serve [serve flags]``."""

import sys

from kernelsight.cli import main

if __name__ == "__main__":      # importing the module (an import check, a doc tool) must not start a server
    sys.exit(main(["serve", *sys.argv[1:]]))
