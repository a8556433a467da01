"""``python -m rankwise run ...``: the same as the ``rankwise`` console script."""

import sys

from rankwise.launch.cli import main

sys.exit(main())
