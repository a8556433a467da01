"""``python -m rankwise run ...``: the same as the ``rankwise`` console script."""

import sys

from rankwise.cli import main

sys.exit(main())
