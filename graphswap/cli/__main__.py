import sys

from graphswap.cli import main

sys.exit(main())
