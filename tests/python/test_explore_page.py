"""The page of `mha explore` in a real browser, headless Chromium through Selenium (issue 16): type a
date and see its translation and every head's map; hover a cell and read its weight; switch a head off
and see the answer, the later maps and the held-out accuracy change to what the API gives for that head
set; see the server's errors (a character outside the vocabulary, an input too long) on the page.
A screenshot of the page with a head off is left in pytest's temporary folder (its path is printed)."""
import pytest

from explore_server import MHA, explore_server, request, wait_for
from test_demo_report import CHROMEDRIVER, CHROMIUM, browser  # noqa: F401 (the browser fixture)

pytestmark = [
    pytest.mark.skipif(not MHA.exists(), reason="build/mha is not built"),
    pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None, reason="chromium / chromium-driver not installed"),
]

HEAD = ("encoder_self", 0, 1)  # the head switched off: (kind, layer, head)


@pytest.fixture(scope="module")
def server(explore_checkpoint):
    with explore_server(explore_checkpoint) as (base, _):
        yield base


def api_answer(base, text, heads_off=()):
    status, answer = request(base, "POST", "/api/translate", {"text": text, "heads_off": list(heads_off)})
    assert status == 200, answer
    return answer


def translated(driver):
    return int(driver.execute_script("return document.body.dataset.translated || '0';"))


def type_text(driver, text):
    """Replaces the input's text by typing it, and waits for the page's next answer or error."""
    before = translated(driver)
    box = driver.find_element("id", "date-input")
    box.clear()
    box.send_keys(text)
    wait_for(lambda: translated(driver) > before or driver.find_element("id", "error").is_displayed(),
             what=f"the page's answer to {text!r}")


def checksums(driver):
    return driver.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('#maps canvas')].map(c => "
        "[`${c.dataset.kind}.${c.dataset.layer}.${c.dataset.head}`, c.dataset.checksum]));")


def text_of(driver, element_id):
    return driver.find_element("id", element_id).text


def accuracy_shown(driver):
    text = text_of(driver, "accuracy")
    return text if text.endswith(")") and "%" in text else None


def test_type_hover_switch_a_head_off_and_see_errors(server, browser, tmp_path):  # noqa: F811
    browser.get(server + "/")
    assert browser.title.startswith("mha explore")
    wait_for(lambda: translated(browser) >= 1, what="the first answer")
    assert len(browser.find_elements("css selector", "#maps canvas")) == 3 * 2 * 2  # kinds x layers x heads
    assert len(browser.find_elements("css selector", "input.head-toggle")) == 12

    text = "the fifth of March 2021"
    type_text(browser, text)
    expected = api_answer(server, text)
    wait_for(lambda: text_of(browser, "translation") == expected["translation"], what="the translation")
    assert text_of(browser, "confidence") == f"{expected['confidence']:.4f}"
    assert not browser.find_element("id", "error").is_displayed()
    wait_for(lambda: accuracy_shown(browser), what="the held-out accuracy")
    status, every = request(server, "POST", "/api/accuracy", {})
    assert status == 200 and accuracy_shown(browser).startswith(f"{100 * every['accuracy']:.1f}% ")
    wait_for(lambda: text_of(browser, "accuracy-baseline") == f"(every head on: {100 * every['accuracy']:.1f}%)",
             what="the accuracy with every head on")
    before = checksums(browser)
    assert all(before.values()) and len(before) == 12

    # Hovering a cell shows its weight: query 0 (the input's first character) reading key 2.
    tooltip = browser.execute_script("""
        const c = document.querySelector('canvas[data-kind="encoder_self"][data-layer="1"][data-head="0"]');
        const r = c.getBoundingClientRect(), size = Number(c.dataset.cell);
        const x = r.left + Number(c.dataset.left) + 2.5 * size, y = r.top + Number(c.dataset.top) + 0.5 * size;
        c.dispatchEvent(new MouseEvent('mousemove', {clientX: x, clientY: y, bubbles: true}));
        const t = document.getElementById('tooltip');
        return [t.hidden, t.textContent];""")
    weight = expected["maps"][0]["layers"][1][0][0][2]
    assert tooltip == [False, f"query 0 't' -> key 2 'e': {weight:.4f}"]

    # Switch a head off: the page shows what the API gives without it.
    kind, layer, head = HEAD
    shown = translated(browser)
    browser.find_element("css selector",
                         f'input.head-toggle[data-kind="{kind}"][data-layer="{layer}"][data-head="{head}"]').click()
    wait_for(lambda: translated(browser) > shown, what="the answer without the head")
    off = api_answer(server, text, [[layer, kind, head]])
    assert text_of(browser, "translation") == off["translation"]
    assert text_of(browser, "confidence") == f"{off['confidence']:.4f}"
    assert off["confidence"] != expected["confidence"]
    after = checksums(browser)
    # The gate acts after a head's attention: layer 0's encoder maps are as before, every later one changed.
    assert all(after[k] == before[k] for k in before if k.startswith("encoder_self.0.")), (before, after)
    changed = [k for k in before if after[k] != before[k]]
    assert any(k.startswith("encoder_self.1.") for k in changed) and any(k.startswith("cross.") for k in changed)
    assert text_of(browser, "heads-off-count") == "1"
    wait_for(lambda: browser.find_element("id", "accuracy").get_attribute("data-heads-off") == "1"
             and accuracy_shown(browser), what="the held-out accuracy without the head")
    status, accuracy = request(server, "POST", "/api/accuracy", {"heads_off": [[layer, kind, head]]})
    assert status == 200 and f"({accuracy['correct']} of {accuracy['examples']})" in accuracy_shown(browser)
    screenshot = tmp_path / "explore.png"
    assert browser.save_screenshot(str(screenshot))
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"screenshot of the explore page: {screenshot}")

    # The server's errors are shown on the page.
    type_text(browser, "5 March 2021 #")
    wait_for(lambda: "'#'" in text_of(browser, "error"), what="the vocabulary error")
    type_text(browser, "5" * 65)
    wait_for(lambda: "at most 64" in text_of(browser, "error"), what="the length error")
    type_text(browser, "5 March 2021")
    wait_for(lambda: not browser.find_element("id", "error").is_displayed(), what="the error to go")
