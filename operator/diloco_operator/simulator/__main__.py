"""`python -m diloco_operator.simulator`: the same as `diloco simulate`."""

import sys

from diloco_operator.simulator.cli import main

sys.exit(main())
