"""The scripts are imported as ``tools`` from the checkout's root, which a bare ``pytest`` does not put on sys.path."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
