"""The harness is imported as ``benchmarks`` from the checkout's root, which ``python -m pytest``
puts on sys.path and a bare ``pytest`` does not."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
