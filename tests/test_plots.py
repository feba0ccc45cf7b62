"""The bench's PNG plots say what they show: every served mode in a style of its own, readable tick labels (the
recall study apart from the throughput panels), the serve plot's prefill phase, labels the titles promise,
assumed figures marked."""
import copy
import json
from pathlib import Path

import matplotlib
import pytest

from cupy_dsa.bench import plots, serve

matplotlib.use("Agg")

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
H200 = json.loads((RESULTS / "h200.json").read_text())
SERVE = json.loads((RESULTS / "h200-serve.json").read_text())


@pytest.fixture
def figs(tmp_path):
    made = []

    def make(doc, name="p.png"):
        out = plots.figures(doc, str(tmp_path / name))
        made.extend(f for _, f in out)
        return out

    yield make
    import matplotlib.pyplot as plt

    for f in made:
        plt.close(f)


def _lines_by_label(fig):
    return {ln.get_label(): ln for ax in fig.axes for ln in ax.get_lines() if not ln.get_label().startswith("_")}


def test_every_recall_format_has_its_own_colour_and_marker(figs):
    """bf16 (served) and bf16-reference shared colour and marker: the flat 93.8% line at 4K read as bf16."""
    formats = sorted({r["format"] for r in H200["recall"]})
    styles = {f: (plots._style(f)["color"], plots._style(f)["marker"]) for f in formats}
    assert len(set(styles.values())) == len(formats), styles
    (_, recall_fig), = [(f, g) for f, g in figs(H200) if f.endswith("-recall.png")]
    drawn = {}
    for label, ln in _lines_by_label(recall_fig).items():
        drawn.setdefault((ln.get_color(), ln.get_marker()), set()).add(label.replace(" (served)", ""))
    assert all(len(v) == 1 for v in drawn.values()), drawn
    assert {"bf16 (served)", "bf16-reference (served)", "bf16-fp4sim (served)", "fp8 (served)"} <= set(
        _lines_by_label(recall_fig))


def test_recall_study_and_throughput_are_separate_readable_figures(figs, tmp_path):
    out = figs(H200, "h.png")
    assert [Path(f).name for f, _ in out] == ["h.png", "h-recall.png"]
    for _, fig in out:
        axes = [ax for ax in fig.axes if ax.axison]
        assert len(axes) <= 9, len(axes)
        sizes = [t.get_fontsize() for ax in axes for t in ax.get_xticklabels() + ax.get_yticklabels()]
        assert sizes and min(sizes) >= plots.TICK_PT, min(sizes)
    written = plots.plot(H200, str(tmp_path / "w.png"))
    assert [Path(p).name for p in written] == ["w.png", "w-recall.png"]
    assert all(Path(p).read_bytes()[:4] == b"\x89PNG" for p in written)


def test_one_kind_of_rows_is_one_file(figs):
    only_recall = dict(copy.deepcopy(H200), logits=[], store=[], bytes=[], query=[])
    assert [Path(f).name for f, _ in figs(only_recall, "r.png")] == ["r.png"]


def test_prefill_labels_are_drawn_as_the_title_says(figs):
    """Without DeepGEMM (a CPU run) the bars carry their time and the title says so (it promised ratios)."""
    doc = copy.deepcopy(H200)
    for r in doc["logits"]:
        r.pop("vs_deepgemm", None)
    (ax,) = _prefill_axes(figs(doc))
    assert ax.get_title().endswith("(label: time)")
    texts = [t.get_text() for t in ax.texts]
    assert texts and all(t.endswith(("ms", "us")) for t in texts), texts
    (ax,) = _prefill_axes(figs(H200))
    assert "DeepGEMM" in ax.get_title() and any(t.get_text().endswith("x DG") for t in ax.texts)


def _prefill_axes(out):
    return [ax for _, fig in out for ax in fig.axes if ax.get_title().startswith("prefill / extend")]


def test_bytes_panel_marks_assumed_models(figs):
    (_, fig), _ = figs(H200)
    (ax,) = [a for a in fig.axes if a.get_title().startswith("KV capacity")]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert "V4-Pro\n(assumed)" in labels and "V4-Flash" in labels, labels
    assert "assumed" in ax.get_title()


def test_serve_plot_shows_prefill_too(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    seen = []
    monkeypatch.setattr(plt.Figure, "savefig", lambda self, *a, **k: seen.append(self))
    serve.plot(SERVE, str(tmp_path / "s.png"))
    titles = [ax.get_title() for ax in seen[0].axes]
    assert any(t.startswith("prefill chunk of") for t in titles) and any(t.startswith("decode step") for t in titles)
    plt.close(seen[0])


def test_recall_study_has_one_legend_with_the_served_formats_marked(figs):
    """The recall plot had 15 legend entries in every panel and did not mark fp8-rescore's served setting."""
    (_, fig), = [(f, g) for f, g in figs(H200) if f.endswith("-recall.png")]
    assert not any(ax.get_legend() for ax in fig.axes)
    legend, = fig.legends
    labels = [t.get_text() for t in legend.get_texts()]
    assert len(labels) <= 11, labels
    served = [lb for lb in labels if lb.endswith("(served)")]
    assert labels[:len(served)] == served and "fp8-rescore-4x-bf16q (served)" in served, labels
    assert not set(plots.PLOT_LEFT_OUT) & {lb.split(" ")[0] for lb in labels}


@pytest.mark.parametrize("png, doc", [("h200.png", "h200.json"), ("h200-recall.png", "h200-recall.json")])
def test_committed_plots_carry_their_json_commit(png, doc):
    """A plot's title names the commit of the JSON it was drawn from (h200.png said another commit, -dirty):
    `cupy-dsa bench report bench/results/h200.json --plot bench/results/h200.png`, then
    `... h200-recall.json --plot bench/results/h200-recall.png` redraw them, no GPU needed."""
    from PIL import Image

    commit = json.loads((RESULTS / doc).read_text())["git_commit"]
    title = Image.open(RESULTS / png).text.get("Title", "")
    assert f"commit {commit}" in title and "dirty" not in title, title
