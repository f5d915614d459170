"""Maintenance scripts of the checkout (not part of the package): ``python -m tools.<name>``."""
