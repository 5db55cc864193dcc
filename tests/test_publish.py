"""How report commands hand out their reports (tracefp4.reports.publish): the text, then the JSON in the
report's own key order, then the figures, each announced once written."""

from __future__ import annotations

import json

import pytest

from tracefp4.reports.publish import publish


def test_text_json_and_one_figure(tmp_path, capsys) -> None:
    report = {"b": 1, "a": [0.5, None]}
    drawn = []

    def plot(rep, path):
        drawn.append((rep, path))
        (tmp_path / "fig.png").write_bytes(b"png")

    publish(report, "the report", str(tmp_path / "r.json"), str(tmp_path / "fig.png"), plot)
    assert capsys.readouterr().out.splitlines() == [
        "the report", f"wrote {tmp_path / 'r.json'}", f"wrote {tmp_path / 'fig.png'}"]
    assert (tmp_path / "r.json").read_text().index('"b"') < (tmp_path / "r.json").read_text().index('"a"')
    assert json.loads((tmp_path / "r.json").read_text()) == report
    assert drawn == [(report, str(tmp_path / "fig.png"))]


def test_a_plot_that_writes_several_files_announces_each(tmp_path, capsys) -> None:
    publish({}, "text", plot_path="s.png", plot=lambda rep, path: [tmp_path / "s.png", tmp_path / "s_layers.png"])
    assert capsys.readouterr().out.splitlines() == ["text", f"wrote {tmp_path / 's.png'}",
                                                    f"wrote {tmp_path / 's_layers.png'}"]


def test_text_only_writes_nothing(tmp_path, capsys) -> None:
    publish({"x": 1}, "only text")
    assert capsys.readouterr().out == "only text\n" and not list(tmp_path.iterdir())


def test_a_plot_path_without_a_plot_function_is_refused() -> None:
    with pytest.raises(ValueError, match="a plot path 'p.png' without a plot function"):
        publish({}, "text", plot_path="p.png")
