"""The e2e cluster harness (README.md). Its modules import each other as top-level modules, as
they do when run as scripts (`python3 e2e/cluster/harness.py up`); importing this package puts its
directory on sys.path, so `from e2e.cluster import harness` finds them the same way."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
