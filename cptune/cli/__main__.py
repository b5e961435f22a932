"""``python -m cptune.cli``: the ``cptune`` command."""

import sys

from cptune.cli import main

if __name__ == "__main__":
    sys.exit(main())
