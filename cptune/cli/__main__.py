"""``python -m cptune.cli``: the ``cptune`` command."""

import sys

from cptune.cli import main

sys.exit(main())
