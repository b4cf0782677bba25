import sys

from graphswap.train.cli import main

sys.exit(main())
