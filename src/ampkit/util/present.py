"""Numbers, tables and pages for people: one way to format every figure ampkit prints (compare, info, doctor)."""

from __future__ import annotations

import html
import io
import os
from collections.abc import Iterable, Sequence
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:  # rich is imported where a table is drawn: the training step's formatters need none of it
    from rich.console import Console
    from rich.padding import Padding
    from rich.table import Table
    from rich.text import Text


def seconds(x: float) -> str:
    """A duration to three significant figures: "4.2 µs", "0.84 ms", "1.2 s"."""
    if x >= 1:
        return f"{x:.3g} s"
    if x >= 1e-3:
        return f"{x * 1e3:.3g} ms"
    return f"{x * 1e6:.3g} µs"


def duration(x: float) -> str:
    """A wall-clock span people plan around: "4.2 s", "45 s", "2 min 20 s", "27 min", "1 h 05 min"."""
    if x < 10:
        return f"{max(0.0, x):.2g} s"
    whole = round(x)
    if whole < 60:
        return f"{whole} s"
    if whole < 600:
        return f"{whole // 60} min {whole % 60:02d} s"
    minutes = round(x / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def flop(x: float) -> str:
    """An amount of floating-point operations: "116 kFLOP", "7.65 GFLOP"."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g} {prefix}FLOP"
    return f"{x:.3g} FLOP"


def flops(x: float) -> str:
    """A rate of floating-point operations: "12.3 GFLOP/s"."""
    return flop(x) + "/s"


def count(x: float) -> str:
    """A per-step count: whole numbers plainly, fractions to two significant figures."""
    return f"{x:.0f}" if x >= 10 or x == int(x) else f"{x:.2g}"


def where(file: str, line: int) -> str:
    """file:line, relative to the working directory when the file is under it."""
    try:
        rel = os.path.relpath(file)
    except ValueError:  # another drive (Windows)
        rel = file
    return f"{file if rel.startswith('..') else rel}:{line}"


def times(x: float) -> str:
    """A ratio: "0.062×", "0.82×", "1.05×", "4.8×", "16×", "215×" (two decimals near 1, where "1×" would
    hide 5%)."""
    if x >= 100:
        return f"{x:.0f}×"
    return f"{x:.2f}".rstrip("0").rstrip(".") + "×" if 0.1 <= x < 10 else f"{x:.2g}×"


def article(name: str) -> str:
    """ "a" or "an" before a device name as it is read aloud: "an A100", "an RTX 4090", "a T4"."""
    return "an" if name[:1].upper() in "AEFHILMNORSX8" else "a"


def percent(x: float) -> str:
    """A share: "38%", and two significant figures below 1% ("0.013%") so that small is not "0%"."""
    return f"{x:.0%}" if x >= 0.01 or x == 0 else f"{x * 100:.2g}%"


# --- tables and pages: every table ampkit prints goes through `table`, every HTML page through `page` ---

NONE = "\u2014"  # "not measured": an em dash, so that an empty cell never reads as zero


def sig(x: float) -> str:
    """Three significant figures, with thousands separators instead of an exponent above 1000."""
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def signed(x: float, decimals: int) -> str:
    """ "+0.7", "−0.1" (a real minus, to line up with "+"), or "±0.0" when it rounds to zero."""
    text = f"{abs(x):.{decimals}f}"
    if float(text) == 0:
        return "\u00b1" + text
    return ("+" if x > 0 else "\u2212") + text


def size(n: float) -> str:
    """Bytes in binary units, as memory is allocated: "1.3 GiB", "780 MiB", "512 B"."""
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return f"{int(n)} B"
    return f"{value:.0f} {unit}" if abs(value) >= 100 else f"{value:.1f} {unit}"


def yes_no(value: bool | None) -> str:
    """A fact that may be unknown: "yes", "no", or "unknown" for None (never a guess)."""
    return {True: "yes", False: "no", None: "unknown"}[value]


def table(
    columns: Sequence[str],
    rows: Iterable[Sequence[str | Text]],
    *,
    title: str | None = None,
    caption: str | None = None,
    numeric_from: int = 1,
    row_styles: Sequence[str | None] = (),
    two_line_headers: bool = False,
    heading: bool = False,
    wrap: bool = False,
    pad_edge: bool = True,
) -> Table:
    """A table as ampkit prints them: numbers right-aligned from column `numeric_from` on, cells not
    wrapped unless `wrap`. Strings go in as `Text`, never as markup, so "[red]" in a user's string prints
    as written; pass a `Text` to style a cell. `two_line_headers` breaks each header at its first space;
    `heading` sets the title as a bold heading on the left rather than centred over the table; `pad_edge=False`
    leaves out the space before the first column and after the last (a wide table that must fit 100 columns)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    out = Table(
        title=Text(title, style="bold" if heading else "") if title else None,
        title_justify="left" if heading else "center",
        caption=Text(caption) if caption else None,
        box=box.SIMPLE_HEAD,
        collapse_padding=True,
        pad_edge=pad_edge,
    )
    for i, name in enumerate(columns):
        out.add_column(
            Text(name.replace(" ", "\n", 1) if two_line_headers else name),
            justify="right" if i >= numeric_from else "left",
            no_wrap=not wrap,
        )
    for i, row in enumerate(rows):
        out.add_row(
            *(c if isinstance(c, Text) else Text(c) for c in row), style=row_styles[i] if i < len(row_styles) else None
        )
    return out


def indented(text: str, spaces: int, style: str = "") -> Padding:
    """`text` indented by `spaces`, its wrapped lines too."""
    from rich.padding import Padding
    from rich.text import Text

    return Padding(Text(text, style=style), (0, 0, 0, spaces), expand=False)


def console(file: IO[str] | None = None) -> Console:
    """A console on stdout (or `file`). A log file has no width: keep tables whole rather than at 80."""
    from rich.console import Console

    out = Console(file=file)
    return out if out.is_terminal else Console(file=file, width=max(out.width, 160))


def as_text(*renderables: Any, width: int = 160) -> str:
    """What `console().print` shows of `renderables`, as plain text without colour: for logs and tests."""
    from rich.console import Console

    buffer = io.StringIO()
    out = Console(file=buffer, width=width, color_system=None)
    for renderable in renderables:
        out.print(renderable)
    return buffer.getvalue()


def escape(value: Any) -> str:
    """Anything as HTML text or attribute: every string on a page came from a user or a run."""
    return html.escape(str(value), quote=True)


# A page loads nothing from anywhere (images are data: URIs, CSS is inline, no script), and says so
# to the browser, so that a page that renders offline cannot secretly depend on the network.
_CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"

_CSS = """
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
       color: #1f2328; background: #ffffff; margin: 0; }
main { max-width: 1100px; margin: 0 auto; padding: 24px 32px 48px; }
h1 { font-size: 26px; margin: 0 0 4px; }
h2 { font-size: 18px; margin: 32px 0 10px; padding-bottom: 4px; border-bottom: 1px solid #d0d7de; }
.sub { color: #57606a; margin: 0 0 12px; }
pre { background: #f6f8fa; border: 1px solid #d0d7de; border-radius: 6px; padding: 10px 14px;
      overflow-x: auto; font: 13px/1.4 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
.warn { background: #fff8c5; border: 1px solid #d4a72c; border-radius: 6px; padding: 8px 14px; }
dl { display: grid; grid-template-columns: max-content 1fr; gap: 2px 18px; margin: 0; }
dt { color: #57606a; } dd { margin: 0; }
table { border-collapse: collapse; width: 100%; font-size: 14px; }
th, td { padding: 6px 8px; border-bottom: 1px solid #d0d7de; text-align: left; white-space: nowrap; }
th { background: #f6f8fa; font-weight: 600; white-space: normal; vertical-align: bottom; }
.scroll { overflow-x: auto; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 16px 0; } figure img { max-width: 100%; height: auto; border: 1px solid #d0d7de; }
figcaption { color: #57606a; font-size: 13px; }
footer { color: #57606a; font-size: 13px; margin-top: 40px; }
"""


def page(title: str, body: str, css: str = "") -> str:
    """A whole self-contained HTML page (works offline, from a file): `body` is HTML, `css` adds rules."""
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{_CSP}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{escape(title)}</title>
<style>{_CSS}{css}</style>
</head>
<body>
<main>
{body}
</main>
</body>
</html>
"""
