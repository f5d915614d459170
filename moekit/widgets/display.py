"""What both explorers share: sliders over a live figure, a figure as display_data, the nearest option."""

from __future__ import annotations

import html
from collections.abc import Callable


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


def live_box(sliders: dict, *, view_for: Callable[[dict], object], figure_for: Callable, per_row: int = 3):
    """A VBox of ``sliders`` (``per_row`` to a row), a line of text and an Output, redrawn on every
    change: ``view = view_for({name: value})``, then ``figure_for(view)`` into the Output and
    ``view.summary()`` into the text. ``box.last_view`` holds the latest view.

    The first draw raises what it raises; an error from a slider is shown in the text line instead
    (its traceback would only reach the server log), and the last good view stays.
    """
    import ipywidgets as w

    shown = list(sliders.values())
    text, out = w.HTML(), w.Output()
    box = w.VBox([*(w.HBox(shown[i : i + per_row]) for i in range(0, len(shown), per_row)), text, out])

    def update(_change=None):
        """Redraw for the sliders' current values (called on every change)."""
        try:
            view = view_for({name: slider.value for name, slider in sliders.items()})
            out.outputs = (display_data(figure_for(view)),)
        except Exception as e:  # from a slider: its traceback would only reach the server log
            if _change is None:
                raise
            text.value = f"<pre>{html.escape(f'{type(e).__name__}: {e}')}</pre>"
            return
        box.last_view, text.value = view, f"<code>{html.escape(view.summary())}</code>"

    for slider in shown:
        slider.observe(update, "value")
    update()
    return box
