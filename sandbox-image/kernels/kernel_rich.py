"""Rich results of the codebroker kernel: loaded by kernel.py (`part("rich")`) on the first
request with `"rich": true`, so a kernel that only prints (LibreChat's answer) does not pay
for it.

For front ends that show values as notebooks do (E2B's interpreter, the Jupyter protocol): a
value becomes a MIME bundle built from its `_repr_*_` methods, as IPython's display formatter
does, with `text/plain` always (its repr). A matplotlib figure becomes `image/png`. Each bundle
goes out through the `send(mime, payload)` the kernel passes, as one `display` event of
BUNDLE_MIME whose data is {"main": bool, "data": {mime: value}}; binary values are base64,
`application/json` an object.

kernel.py gives this module, before it runs, what it shares with the kernel:
`flush_output`, `register_source` and `TOOL_PREFIX` (unused here).
"""

import io
import sys

BUNDLE_MIME = "application/x.codebroker-bundle+json"
ERROR_MIME = "application/x.codebroker-error+json"

# The `_repr_*_` methods a bundle is made of, by MIME type (IPython's display formatter).
REPR_METHODS = (
    ("text/html", "_repr_html_"),
    ("text/markdown", "_repr_markdown_"),
    ("image/svg+xml", "_repr_svg_"),
    ("image/png", "_repr_png_"),
    ("image/jpeg", "_repr_jpeg_"),
    ("text/latex", "_repr_latex_"),
    ("application/json", "_repr_json_"),
    ("application/javascript", "_repr_javascript_"),
    ("application/pdf", "_repr_pdf_"),
)


def is_figure(value):
    figure = sys.modules.get("matplotlib.figure")
    return figure is not None and isinstance(value, getattr(figure, "Figure", ()))


def figure_png(figure):
    import base64

    buf = io.BytesIO()
    figure.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def mime_bundle(value):
    """{mime: value} for `value`: its `_repr_*_` results (binary ones base64, JSON as
    an object) and its repr as text/plain. A method that fails is left out."""
    import base64

    bundle = {}
    for mime, name in REPR_METHODS:
        method = getattr(type(value), name, None)
        if method is None:
            continue
        try:
            shown = method(value)
        except Exception:
            continue
        if isinstance(shown, tuple):  # (data, metadata)
            shown = shown[0] if shown else None
        if shown is None:
            continue
        if isinstance(shown, (bytes, bytearray)):
            shown = base64.b64encode(bytes(shown)).decode("ascii")
        elif mime != "application/json" and not isinstance(shown, str):
            shown = str(shown)
        bundle[mime] = shown
    if is_figure(value):
        try:
            bundle["image/png"] = figure_png(value)
        except Exception:
            pass
    try:
        bundle["text/plain"] = repr(value)
    except Exception:
        bundle["text/plain"] = "<%s object>" % type(value).__name__
    return bundle


def show(value, main, send):
    """Sends `value`'s bundle; `main`: it is the cell's result (a trailing expression)."""
    bundle = mime_bundle(value)
    if bundle:
        send(BUNDLE_MIME, {"main": main, "data": bundle})


def display_function(send):
    """`display(obj, ...)`: each value as a bundle (IPython's display(), as notebooks and
    E2B's interpreter offer it)."""

    def display(*values, **_options):
        for value in values:
            show(value, False, send)

    return display


def show_open_figures(send):
    """Figures the cell left open are shown and closed, as a notebook's inline backend
    does."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    try:
        for num in plt.get_fignums():
            fig = plt.figure(num)
            try:
                send(BUNDLE_MIME, {"main": False, "data": {"image/png": figure_png(fig), "text/plain": repr(fig)}})
            finally:
                plt.close(fig)
    except Exception:
        pass
