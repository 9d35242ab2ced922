"""``python -m ggmux.instance``: see :mod:`ggmux.instance.server`."""

import sys

from .server import main

sys.exit(main())
