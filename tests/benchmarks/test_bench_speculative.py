"""bench_speculative's summary: a config's `x off` is the median of its rounds' own ratios."""

from benchmarks.bench_speculative import summarize_cells


def _r(tok_s: float, accept: float | None = None) -> dict:
    return {"tok_s": tok_s, "tokens": 96, "verifies": 48, "accept": accept}


def test_x_off_is_the_median_of_each_rounds_ratio_not_the_ratio_of_medians():
    # the machine slows in round 2; NGRAM is 1.5x of off in rounds 1 and 2 and 0.9x in 3
    runs = {"extraction/b1": {"off": [_r(200.0), _r(100.0), _r(200.0)],
                              "NGRAM": [_r(300.0, 2.0), _r(150.0, 2.0), _r(180.0, 1.9)]}}
    cell = summarize_cells(runs)["extraction/b1"]
    assert cell["off"]["tok_s"] == 200.0 and "x_off" not in cell["off"]
    assert cell["NGRAM"]["tok_s"] == 180.0  # the median round of its own
    assert cell["NGRAM"]["x_off_rounds"] == [0.9, 1.5, 1.5]
    assert cell["NGRAM"]["x_off"] == 1.5  # the ratio of the medians would read 0.90


def test_without_off_no_ratio():
    cell = summarize_cells({"chat/b8": {"NGRAM": [_r(10.0), _r(30.0), _r(20.0)]}})["chat/b8"]
    assert cell["NGRAM"]["tok_s"] == 20.0 and "x_off" not in cell["NGRAM"]


def test_learning_curve_counts_a_heads_whole_lineage_and_fits_over_log_data():
    import math
    import pathlib

    from benchmarks import bench_head_learning_curve as lc
    from sglang_like.speculative import DEFAULT_HEAD

    card = "- Data: ...\n  318159 answer tokens, 462842 tokens in all.\n## Earlier training\n" \
           "  866681 tokens in all.\n### Earlier\n  870721 tokens in all.\n"
    assert lc.lineage_tokens(card) == 462842 + 866681 + 870721
    # the shipped head's card lists every run of its lineage
    shipped = (pathlib.Path(DEFAULT_HEAD) / "README.md").read_text()
    assert lc.lineage_tokens(shipped) > 2_000_000
    slope, icpt = lc.fit_line([5.0, 6.0, 7.0], [1.2, 1.4, 1.6])
    assert math.isclose(slope, 0.2) and math.isclose(icpt, 0.2)
    assert lc.fit_line([6.0], [1.5]) is None and lc.fit_line([6.0, 6.0], [1.4, 1.5]) is None
