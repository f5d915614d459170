"""What both explorers share: a figure into an Output widget, and the nearest slider option."""

from __future__ import annotations


def display_data(obj) -> dict:
    """``obj`` as a display_data output, for ``Output.outputs = (display_data(fig),)``.

    The figure goes into the Output widget's state, not through ``with out: display(...)``.
    Captured output makes a headless runner (nbclient, so papermill) echo the widget state to
    the kernel on the shell socket while it waits there for the cell's reply; that race can
    stall it until its cell timeout (seen: 600 s) before it carries on.
    """
    from IPython import get_ipython

    shell = get_ipython()
    data, metadata = shell.display_formatter.format(obj) if shell is not None else ({"text/plain": repr(obj)}, {})
    return {"output_type": "display_data", "data": data, "metadata": metadata}


def nearest(value, options):
    """The option closest to ``value`` (the smaller one on a tie)."""
    return min(options, key=lambda o: (abs(o - value), o))
