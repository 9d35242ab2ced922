"""``python -m ggmux``: the ``ggmux`` command (see :mod:`ggmux.supervisor.cli`)."""

import sys

from .supervisor.cli import main

sys.exit(main())
