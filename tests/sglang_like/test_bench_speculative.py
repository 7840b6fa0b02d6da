"""bench_speculative's summary: a config's `x off` is the median of its rounds' own ratios."""

from sglang_like.bench_speculative import summarize_cells


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
