"""Deprecated: ``python -m graphswap.cli`` (what torchrun users typed in 0.1.0) runs the
``graphswap`` command; use ``graphswap`` or ``python -m graphswap.train.cli``."""

import sys

from graphswap._deprecated import warn
from graphswap.train.cli import main

warn("python -m graphswap.cli is deprecated: use python -m graphswap.train.cli")
sys.exit(main())
