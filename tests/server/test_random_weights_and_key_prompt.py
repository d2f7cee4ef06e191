"""The server over a make-model checkpoint says its weights are random: a line in its log, a field of /health, a
banner on the web page. And the page asks for the API key when the server answers 401 invalid_api_key, keeps it
in localStorage and sends it as a Bearer token (headless Chromium, as test_web_page.py drives it)."""

import json

import pytest
from chromium import needs_chromium, start_browser
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from hybridmoe.commands.doctor import RANDOM_WEIGHTS_LINE
from hybridmoe.server.app import RANDOM_WEIGHTS_BANNER, index_page


def test_the_page_carries_the_banner_only_for_random_weights():
    assert RANDOM_WEIGHTS_BANNER in index_page(True) and "<!--random-weights-->" not in index_page(True)
    assert 'id="random-weights"' not in index_page(False)


def test_a_server_over_random_weights_says_so(server):
    code, page = server.get("/")
    assert code == 200 and RANDOM_WEIGHTS_BANNER in page.decode()
    code, health = server.get("/health")
    assert code == 200 and json.loads(health)["random_weights"] is True
    assert RANDOM_WEIGHTS_LINE in server.log_path.read_text().splitlines()




@pytest.fixture(scope="module")
def browser():
    driver = start_browser()
    yield driver
    driver.quit()


@needs_chromium
def test_the_page_asks_for_the_key_keeps_it_and_sends_it(small_server, browser):
    browser.get(small_server.url + "/")
    browser.execute_script("localStorage.clear()")
    browser.get(small_server.url + "/")  # no key: /v1/models answers 401 invalid_api_key
    prompt = browser.find_element(By.ID, "key-prompt")
    # the page shows the prompt, then (after reading the 401's body) says the model is unavailable
    WebDriverWait(browser, 20).until(lambda d: prompt.is_displayed()
                                     and "model unavailable" in d.find_element(By.ID, "model").text)
    browser.find_element(By.ID, "key-prompt-input").send_keys(small_server.api_key, Keys.ENTER)
    WebDriverWait(browser, 20).until(lambda d: d.find_element(By.ID, "model").text == "tiny")
    assert not prompt.is_displayed()
    assert browser.execute_script("return localStorage.getItem('hybridmoe:api-key')") == small_server.api_key
    browser.refresh()  # the kept key is sent at once
    WebDriverWait(browser, 20).until(lambda d: d.find_element(By.ID, "model").text == "tiny")
    assert not browser.find_element(By.ID, "key-prompt").is_displayed()
    box = browser.find_element(By.ID, "input")
    box.send_keys("Hello with the kept key", Keys.ENTER)
    WebDriverWait(browser, 30).until(lambda d: d.execute_script(
        "const m = document.querySelectorAll('.msg.assistant'); return m.length && m[0].dataset.state === 'done'"))
    assert not browser.find_elements(By.CSS_SELECTOR, ".msg.error")
    assert browser.find_element(By.CSS_SELECTOR, ".msg.assistant .content").text
