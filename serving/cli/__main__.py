"""``python -m serving.cli``: the ``moejax`` command."""

import sys

from serving.cli import main

sys.exit(main())
