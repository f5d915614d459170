"""``python -m moekit.cli <command>`` (see :mod:`moekit.cli`)."""

import sys

from moekit.cli import main

sys.exit(main())
