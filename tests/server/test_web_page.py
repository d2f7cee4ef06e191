"""The web chat page at / in headless Chromium (Debian's chromium + chromedriver, via selenium):
type a message, watch the reply stream in, and find it equal to the API's greedy answer for the
same conversation, over two turns; then the same through a server that wants an API key."""

import pytest

pytest.importorskip("selenium.webdriver")
from chromium import needs_chromium, start_browser  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = needs_chromium
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def browser():
    driver = start_browser()
    yield driver
    driver.quit()


def _set(driver, element_id, value):
    el = driver.find_element(By.ID, element_id)
    el.clear()
    el.send_keys(value)
    driver.execute_script("arguments[0].dispatchEvent(new Event('change'))", el)


def _open(driver, server, api_key=""):
    driver.get(server.url + "/")
    driver.execute_script("localStorage.clear()")
    driver.get(server.url + "/")
    _set(driver, "api-key", api_key)
    _set(driver, "temperature", "0")
    _set(driver, "max-tokens", str(MAX_TOKENS))
    WebDriverWait(driver, 20).until(lambda d: d.find_element(By.ID, "model").text == "tiny")


def _say(driver, text) -> str:
    """Send a message with Enter, wait for the streamed reply to finish, return its text."""
    box = driver.find_element(By.ID, "input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)
    WebDriverWait(driver, 30).until(lambda d: d.execute_script(
        "const m = document.querySelectorAll('.msg.assistant');"
        "return m.length && m[m.length - 1].dataset.state === 'done'"))
    assert not driver.find_elements(By.CSS_SELECTOR, ".msg.error")
    return driver.execute_script(
        "const m = document.querySelectorAll('.msg.assistant .content'); return m[m.length - 1].textContent")


def test_page_streams_a_two_turn_chat(server, browser):
    _open(browser, server)
    client = server.client()
    history = []
    for question in ("Hello there", "And a second question"):
        reply = _say(browser, question)
        history.append({"role": "user", "content": question})
        expected = client.chat.completions.create(model="tiny", messages=history, temperature=0,
                                                  max_tokens=MAX_TOKENS).choices[0].message.content
        assert reply == expected and reply
        history.append({"role": "assistant", "content": reply})
    assert len(browser.find_elements(By.CSS_SELECTOR, ".msg.user")) == 2


def test_page_works_with_the_api_key(small_server, browser):
    _open(browser, small_server, api_key=small_server.api_key)
    assert _say(browser, "Hello with a key")
