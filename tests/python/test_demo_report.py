"""The report `mha demo` writes (index.html), opened in a real browser, headless Chromium through
Selenium (issue 15): the page loads, every image loads, and the page explains itself (what a query, a
key and a head are; the three kinds of attention; a legend for the boxes drawn on the maps; which head
reads the date's fields, with the number from this run; the formats in words; the years it reads).
A screenshot of the page is left in pytest's temporary folder (its path is printed).

scripts/install-deps.sh installs chromium, chromium-driver and python3-selenium, so `make test` runs
these; they are skipped only where those are missing."""
import json
import os
import pathlib
import re
import shutil
import struct
import zlib

import numpy as np
import pytest

from test_demo_command import MHA, SHORT, mha

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
webdriver = pytest.importorskip("selenium.webdriver", reason="python3-selenium is not installed")

pytestmark = [
    pytest.mark.skipif(not MHA.exists(), reason="build/mha is not built"),
    pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None, reason="chromium / chromium-driver not installed"),
]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_report") / "report"
    result = mha("demo", "--out", out, *SHORT)
    assert result.returncode == 0, result.stdout + result.stderr
    return out


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium.webdriver.chrome.service import Service
    # Chromium's profile and its singleton socket folder go under pytest's temporary folder (TMPDIR),
    # not into /tmp, where they would stay behind after each run.
    scratch = tmp_path_factory.mktemp("chromium")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1400,1000", f"--user-data-dir={scratch / 'profile'}"):
        options.add_argument(argument)
    service = Service(CHROMEDRIVER, env=dict(os.environ, TMPDIR=str(scratch)))
    driver = webdriver.Chrome(service=service, options=options)
    yield driver
    driver.quit()


def open_page(driver, folder):
    """Loads folder/index.html and checks that it loaded with every image; returns the page's images'
    src attributes. driver.get returns after the load event, when every image has loaded or failed."""
    driver.get((folder / "index.html").as_uri())
    assert driver.title == "mha demo: a Transformer that reads dates", driver.title
    images = driver.execute_script(
        "return Array.from(document.images).map(i => [i.getAttribute('src'), i.complete, i.naturalWidth]);")
    broken = [src for src, complete, width in images if not (complete and width > 0)]
    assert not broken, f"images that did not load: {broken}"
    return [src for src, _, _ in images]


def text_of(driver, css):
    return driver.find_element("css selector", css).text


def test_report_loads_in_a_browser_with_every_image(report, browser, tmp_path):
    sources = open_page(browser, report)
    files = sorted(p.name for p in report.glob("example*.png")) + ["learning_curve.svg"]
    assert set(sources) == set(files), set(sources) ^ set(files)  # every map is on the page
    height = browser.execute_script("return document.documentElement.scrollHeight;")
    browser.set_window_size(1400, min(height + 100, 16000))
    screenshot = tmp_path / "report.png"
    assert browser.save_screenshot(str(screenshot))
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"screenshot of the report: {screenshot}")


def test_a_missing_image_fails_the_check(report, browser, tmp_path):
    copy = tmp_path / "report"
    shutil.copytree(report, copy)
    (copy / "example1_cross_layer0_head1.png").unlink()
    with pytest.raises(AssertionError, match="example1_cross_layer0_head1.png"):
        open_page(browser, copy)


def test_report_explains_queries_keys_heads_and_the_three_kinds(report, browser):
    open_page(browser, report)
    assert text_of(browser, "#query").startswith("A query is what a position is looking for")
    assert text_of(browser, "#key").startswith("A key is how a position says what it holds")
    assert "value" in text_of(browser, "#key")
    assert text_of(browser, "#head").startswith("A head is") and "2 heads in every attention layer" in text_of(
        browser, "#head")
    # next to the first map: the explanation and the first example's best encoder-decoder map side by side
    first_map = browser.find_element("css selector", ".explain figure img")
    paragraphs = browser.find_element("css selector", ".explain > div")
    assert first_map.location["x"] > paragraphs.location["x"] + paragraphs.size["width"] / 2
    assert abs(first_map.location["y"] - paragraphs.location["y"]) < 200
    kinds = [e.text for e in browser.find_elements("css selector", "dt")]
    assert kinds == ["encoder self-attention", "decoder masked self-attention", "encoder-decoder attention"]
    descriptions = [e.text for e in browser.find_elements("css selector", "dd")]
    assert "cannot look ahead" in descriptions[1] and "upper-right triangle" in descriptions[1]
    assert "reads the source" in descriptions[2]


def legend_colours(driver):
    """field name -> (r, g, b) of its box in the page's legend."""
    legend = driver.find_element("css selector", "#legend")
    boxes = legend.find_elements("css selector", "span.box")
    colours = [tuple(map(int, re.findall(r"\d+", b.value_of_css_property("border-top-color"))[:3])) for b in boxes]
    assert len(colours) == 3 and len(set(colours)) == 3, colours
    return dict(zip(("year", "month", "day"), colours))


def test_the_best_head_is_named_with_its_share_from_this_run(report, browser):
    open_page(browser, report)
    assert set(legend_colours(browser)) == {"year", "month", "day"}
    assert "year" in text_of(browser, "#legend") and "weekday is no field" in text_of(browser, "#legend")
    summary = json.loads((report / "summary.json").read_text())
    findings = [e.text for e in browser.find_elements("css selector", "p.finding")]
    assert len(findings) == len(summary["maps"]) == 2
    best_cells = browser.find_elements("css selector", "td.maps.best img")
    assert len(best_cells) == 2
    for i, (finding, shown, best_cell) in enumerate(zip(findings, summary["maps"], best_cells)):
        m = re.search(r"layer (\d+) head (\d+) puts (\d+)% of the weight of the rows that write the year, month "
                      r"and day on those fields' characters in the source \(boxed\)", finding)
        assert m, finding
        layer, head, share = int(m.group(1)), int(m.group(2)), m.group(3)
        assert 0 <= int(share) <= 100
        best = max(shown["cross_shares"], key=lambda s: s["share"])
        # compared as text, formatted as demo_report.cpp's percent() formats it (round(), ties to even, would
        # differ from "{:.0f}" at an exact half)
        assert (layer, head) == (best["layer"], best["head"]) and share == f"{100 * best['share']:.0f}", finding
        assert best_cell.get_attribute("src").endswith(f"example{i}_cross_layer{layer}_head{head}.png")
        # the shares are what a [11, S] row-stochastic matrix can give on the fields' spans
        assert all(0.0 <= s["share"] <= 1.0 for s in shown["cross_shares"])
        spans = shown["fields"]
        source = shown["source"]
        assert all(0 <= spans[f][0] < spans[f][1] <= len(source) for f in ("year", "month", "day")), spans
        assert shown["even_share"] == pytest.approx(
            (4 * (spans["year"][1] - spans["year"][0]) + 2 * (spans["month"][1] - spans["month"][0]) +
             2 * (spans["day"][1] - spans["day"][0])) / (8 * len(source)), rel=1e-5)


def png_rgb(path):
    """The pixels of an 8-bit RGB PNG as an array [height, width, 3], decoded with zlib alone."""
    data = pathlib.Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    at, idat = 8, b""
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour_type = struct.unpack(">IIBB", body[:10])
            assert (depth, colour_type) == (8, 2), "not 8-bit RGB"
        elif kind == b"IDAT":
            idat += body
        at += 12 + length
    raw = zlib.decompress(idat)
    stride = 3 * width
    pixels = np.zeros((height, stride), np.int64)
    previous = np.zeros(stride, np.int64)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1).astype(np.int64)
        if kind == 2:  # up
            line = (line + previous) % 256
        elif kind in (1, 3, 4):  # sub, average, Paeth: each byte depends on the one 3 to its left
            for i in range(stride):
                a = line[i - 3] if i >= 3 else 0
                b, c = previous[i], previous[i - 3] if i >= 3 else 0
                if kind == 1:
                    predictor = a
                elif kind == 3:
                    predictor = (a + b) // 2
                else:
                    p = a + b - c
                    predictor = a if abs(p - a) <= abs(p - b) and abs(p - a) <= abs(p - c) else (
                        b if abs(p - b) <= abs(p - c) else c)
                line[i] = (line[i] + predictor) % 256
        pixels[y] = line
        previous = line
    return pixels.reshape(height, width, 3)


def test_the_fields_are_boxed_on_the_encoder_decoder_maps_in_the_legends_colours(report, browser):
    open_page(browser, report)
    colours = legend_colours(browser)
    for example in (0, 1):
        cross = png_rgb(report / f"example{example}_cross_layer0_head0.png")
        encoder = png_rgb(report / f"example{example}_encoder_self_layer0_head0.png")
        for field, colour in colours.items():
            drawn = np.all(cross == colour, axis=2)
            assert drawn.sum() > 100, (example, field)  # an outline, 3 pixels wide
            assert not np.all(encoder == colour, axis=2).any(), (example, field)  # boxes only where fields are read
        # the year's box spans 4 rows, the month's and the day's 2: the outlines' heights say so
        heights = {f: np.ptp(np.nonzero(np.all(cross == c, axis=2))[0]) for f, c in colours.items()}
        assert heights["year"] > 1.7 * heights["month"] and abs(heights["month"] - heights["day"]) <= 1, heights


def test_formats_are_named_in_words_with_an_example(report, browser):
    open_page(browser, report)
    table = browser.find_element("xpath", "//h2[text()='Accuracy by format']/following-sibling::table[1]")
    rows = [[c.text for c in r.find_elements("css selector", "th, td")]
            for r in table.find_elements("css selector", "tr")[1:]]
    assert len(rows) == 18
    for words, example, score in rows:
        assert not re.search(r"\b(yyyy|yy|mm|dd|Mon|d|m)\b", words), words  # no shorthand
        assert len(words.split()) >= 3 and re.search(r"\d", example), (words, example)
        assert re.fullmatch(r"\d+/\d+|none drawn", score), score
    help_text = mha("translate", "--help").stdout
    for words, example, _ in rows:  # the same words in `mha translate --help`
        assert re.search(re.escape(example) + r"\s+" + re.escape(words), help_text), (words, help_text)


def test_the_supported_range_and_what_happens_outside_it(report, browser):
    open_page(browser, report)
    section = browser.find_element("xpath", "//h2[starts-with(text(), 'What it reads')]")
    text = section.find_element("xpath", "following-sibling::p[1]").text + section.find_element(
        "xpath", "following-sibling::p[2]").text
    assert "1950 to 2049" in text and "exits with status 3" in text and "exit status 1" in text
    summary = json.loads((report / "summary.json").read_text())
    table = section.find_element("xpath", "following-sibling::table[1]")
    shown = [[c.text for c in r.find_elements("css selector", "th, td")]
             for r in table.find_elements("css selector", "tr")[1:]]
    assert shown == [[a["input"], a["line"]] for a in summary["outside_range"]]
    checkpoint = report / "checkpoint.safetensors"
    for row in summary["outside_range"]:  # what the page says translate prints is what it prints
        result = mha("translate", "--checkpoint", checkpoint, row["input"])
        assert result.stdout.strip() == row["line"] and result.returncode == (3 if row["marked"] else 0), result
        if re.search(r"1949|2050|1492", row["input"]):
            assert row["marked"] and row["line"].startswith("? "), row


def test_the_cache_dtype_table_shows_each_caches_accuracy_and_divergence(report, browser):
    open_page(browser, report)
    table = browser.find_element("css selector", "table#kv-cache")
    assert table.is_displayed()
    rows = [[c.text for c in r.find_elements("css selector", "th, td")]
            for r in table.find_elements("css selector", "tr")]
    assert rows[0] == ["cache", "greedy", "2 beams", "4 beams", "mean KL from float32", "decode time"]
    summary = json.loads((report / "summary.json").read_text())
    assert [r[0] for r in rows[1:]] == [c["kv_cache"] for c in summary["kv_caches"]] == ["float32", "int8", "fp8"]
    for row, c in zip(rows[1:], summary["kv_caches"]):
        assert row[1:4] == [f"{100 * a:.1f}%" for a in c["held_out_exact_match"]]
    assert rows[1][4] == "0"  # float32 against itself
    assert "--kv-cache" in table.find_element("xpath", "preceding-sibling::p[1]").text
