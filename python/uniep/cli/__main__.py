"""``python -m uniep.cli``: the ``uniep`` command."""

import sys

from . import main

sys.exit(main())
