"""How a report command hands its report out, every report the same way: the text on stdout, then with
``--json`` the report as JSON and with ``--plot`` its figures, each file announced (``wrote <path>``)
only once it is whole (written atomically: an interrupted command leaves no partial file)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from tracefp4.files import atomic_write_json

__all__ = ["publish"]


def publish(
    report: Mapping[str, Any],
    text: str,
    json_path: str | None = None,
    plot_path: str | None = None,
    plot: Callable[[Mapping[str, Any], str], Iterable[str | Path] | None] | None = None,
) -> None:
    """Print ``text`` (the report formatted); write ``report`` to ``json_path`` in its own key order and
    ``plot(report, plot_path)`` where given. ``plot`` returns the files it wrote when they are more than
    ``plot_path`` (None: that one file)."""
    print(text)
    if json_path:
        atomic_write_json(json_path, report, sort_keys=False)
        print(f"wrote {json_path}")
    if plot_path:
        if plot is None:
            raise ValueError(f"publish: a plot path {plot_path!r} without a plot function")
        written = plot(report, plot_path)
        for path in [plot_path] if written is None else written:
            print(f"wrote {path}")
