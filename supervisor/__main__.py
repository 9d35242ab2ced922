"""``python -m ggmux.supervisor`` is ``ggmux``."""

import sys

from .cli import main

sys.exit(main())
