"""``python -m ggmux.proxy``: see :mod:`ggmux.proxy.server`."""

import sys

from .server import main

sys.exit(main())
