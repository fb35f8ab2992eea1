"""The operator's page in a real browser (headless Chromium through playwright): it loads with
no console errors, shows every role of a live stack, lists a request within 2 s of its end
and draws its waterfall from router, prefill and decode spans in time order, marks a killed
worker gone within its heartbeat bound, and with API keys on asks for an admin key and
refuses a user key. Each state's screenshot is kept under test-artifacts/dashboard/.

`make test` installs Debian's chromium where it can (root and apt); without a browser these
tests are skipped, saying how to get one."""

from __future__ import annotations

import json
import re
import shutil
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.messages.heartbeat import ROLES
from tests.procs import REPO
from tests.procs import kvmesh_keys as keys
from tests.stack import TINY_ENCODER, Stack

ARTIFACTS = REPO / "test-artifacts" / "dashboard"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_browser = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no Chromium: `apt-get install chromium` (make test does it when run as root)",
)
LONG = "The harbour office keeps a log of every berth, tide and pilot. " * 12  # past prefill


@pytest.fixture(scope="module")
def stack(stacks) -> Stack:
    return stacks(
        ("router-0", "cachemeta-0", "prefill-0", "decode-0", "encoder-0"),
        KVMESH_ROUTER_LOCAL_PREFILL_MAX_TOKENS="0",  # every request through prefill and decode
        **TINY_ENCODER,
    )


@pytest.fixture(scope="module")
def browser() -> Iterator:
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


class Page:
    """A tab on the dashboard, with its console errors collected."""

    def __init__(self, browser, url: str) -> None:  # noqa: ANN001
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.errors: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(f"{url}/dashboard")

    def shot(self, name: str) -> None:
        self.page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


@needs_browser
def test_the_page_shows_every_role_with_no_console_errors(stack: Stack, browser) -> None:  # noqa: ANN001
    tab = Page(browser, stack.url)
    for role in ROLES:
        tab.page.wait_for_selector(f"#mesh tr[data-service^='{role}-']", timeout=10_000)
    states = tab.page.eval_on_selector_all(
        "#mesh tbody tr", "rows => rows.map(r => r.dataset.state)"
    )
    assert set(states) == {"ready"}
    tab.page.wait_for_selector("#figures tbody tr")
    # A mesh up for minutes says its per-day figures are projected from them, not 24 h.
    assert "extrapolated from them" in tab.page.inner_text("#figures-window")
    # The plan an autoscaler follows: each pool's recommendation beside its size now.
    tab.page.wait_for_function("document.querySelector('#plan').textContent.length > 0")
    plan = tab.page.inner_text("#plan")
    assert "prefill" in plan and "decode" in plan and "(now 1)" in plan
    tab.shot("mesh")
    assert tab.errors == []
    tab.page.close()


@needs_browser
def test_a_request_is_listed_within_2s_and_opens_its_waterfall(stack: Stack, browser) -> None:  # noqa: ANN001
    tab = Page(browser, stack.url)
    tab.page.wait_for_selector("#mesh tr[data-service]")
    req = urllib.request.Request(
        f"{stack.url}/v1/chat/completions",
        json.dumps(
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": LONG}],
                "max_tokens": 6,
                "temperature": 0,
            }
        ).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        rid = resp.headers["x-request-id"]
        resp.read()
    # Listed within 2 s of its end (the page polls every second).
    row = tab.page.wait_for_selector(f"#requests tr[data-request='{rid}']", timeout=2_000)
    row.click()
    tab.page.wait_for_selector("#waterfall .span-row", timeout=5_000)

    def services() -> list[str]:
        return tab.page.eval_on_selector_all(
            "#waterfall .span-row", "rows => rows.map(r => r.dataset.service)"
        )

    deadline = time.monotonic() + 5  # (each service's spans are in its memory at once)
    while not {"router-0", "prefill-0", "decode-0"} <= set(services()):
        assert time.monotonic() < deadline, services()
        tab.page.click(f"#requests tr[data-request='{rid}']")
        tab.page.wait_for_timeout(300)
    order = services()
    first = {sid: order.index(sid) for sid in ("router-0", "prefill-0", "decode-0")}
    assert first["router-0"] < first["prefill-0"] < first["decode-0"]  # the path, in time
    decision = tab.page.inner_text("#decision")
    assert "prefill-0" in decision and "ttft_s" in decision
    # Its class's row: its requests and TTFT (the figures are read every few seconds).
    tab.page.wait_for_selector("#classes tbody tr", timeout=15_000)
    assert tab.page.inner_text("#classes tbody tr td").strip() == "default"
    tab.shot("waterfall")
    assert tab.errors == []
    tab.page.close()


@needs_browser
def test_a_killed_worker_turns_gone_within_its_heartbeat_bound(stack: Stack, browser) -> None:  # noqa: ANN001
    stack.start("decode-1")
    stack.wait_ready(["decode-1"])
    tab = Page(browser, stack.url)
    tab.page.wait_for_selector("#mesh tr[data-service='decode-1'][data-state='ready']")
    with urllib.request.urlopen(f"{stack.url}/v1/dashboard/mesh", timeout=10) as resp:
        mesh = json.loads(resp.read())
    # The bound: the beats a service may miss × their interval, then the router's sweep and
    # the page's next poll.
    bound = mesh["missed_heartbeats"] * mesh["heartbeat_s"] + 1.0 + 1.0
    stack.procs["decode-1"].signal(signal.SIGKILL)
    tab.page.wait_for_selector(
        "#mesh tr[data-service='decode-1'][data-state='gone']", timeout=bound * 1000
    )
    tab.shot("gone")
    assert tab.errors == []
    tab.page.close()


@needs_browser
def test_with_keys_on_the_page_wants_an_admin_key(stack: Stack, browser, tmp_path: Path) -> None:  # noqa: ANN001
    path = tmp_path / "keys.toml"
    user = keys(path, "add", "--tenant", "harbour")
    admin = keys(path, "add", "--tenant", "ops", "--admin")
    url = stack.router("router-keys", KVMESH_ROUTER_KEYS_FILE=str(path))
    try:
        tab = Page(browser, url)
        tab.page.wait_for_selector("#login:not([hidden])")
        assert tab.page.is_hidden("#main")
        tab.shot("login")
        tab.page.fill("#key", user)
        tab.page.click("#login-form button")
        tab.page.wait_for_function(
            "document.querySelector('#login-error').textContent.includes('admin')"
        )
        assert tab.page.is_hidden("#main")
        tab.shot("user-key-refused")
        tab.page.fill("#key", admin)
        tab.page.click("#login-form button")
        tab.page.wait_for_selector("#mesh tr[data-service]")
        assert tab.page.is_hidden("#login")
        tab.page.reload()  # the key stays for the session
        tab.page.wait_for_selector("#mesh tr[data-service]")
        tab.shot("admin")
        # (a 401 logged by the browser for the first unauthenticated poll is expected)
        assert [e for e in tab.errors if "401" not in e and "403" not in e] == []
        tab.page.close()
    finally:
        stack.procs["router-keys"].stop()


# -- without a browser: the API, and Grafana's dashboard against the metrics served ----------


def get(url: str, key: str = "") -> tuple[int, dict | str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            body = resp.read().decode()
            return resp.status, json.loads(body) if "json" in resp.headers["Content-Type"] else body
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def exposed_names(text: str) -> set[str]:
    """Every sample name a /metrics page can have, from its TYPE lines (a labelled counter
    with no sample yet is declared all the same)."""
    suffixes = {
        "counter": ("",),  # (declared with its _total)
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "gauge": ("",),
        "summary": ("", "_sum", "_count"),
    }
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names |= {name + s for s in suffixes.get(kind, ("",))}
    return names


def test_grafanas_dashboard_uses_only_metrics_the_services_serve(stack: Stack) -> None:
    dashboard = json.loads((REPO / "deploy/grafana/dashboards/kvmesh.json").read_text())
    used = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"kvmesh_[a-z_]+", target["expr"])
    }
    assert len(used) >= 10
    served: set[str] = set()
    _, mesh = get(f"{stack.url}/v1/dashboard/mesh")
    for service in mesh["services"]:
        _, text = get(f"{service['address']}/metrics")
        served |= exposed_names(text)
    assert used <= served, sorted(used - served)


def test_the_dashboard_api_wants_an_admin_key_and_names_bad_input(
    stack: Stack, tmp_path: Path
) -> None:
    status, body = get(f"{stack.url}/v1/dashboard/series?minutes=0")
    assert status == 400 and body["error"]["param"] == "minutes"
    status, series = get(f"{stack.url}/v1/dashboard/series?minutes=5")
    assert status == 200 and len(series["minutes"]) == 5
    assert {"ttft_p50_ms", "ttft_p99_ms", "hit_ratio_memory", "input_tok_s"} <= set(
        series["minutes"][-1]
    )
    path = tmp_path / "keys.toml"
    user = keys(path, "add", "--tenant", "harbour")
    admin = keys(path, "add", "--tenant", "ops", "--admin")
    url = stack.router("router-api-keys", KVMESH_ROUTER_KEYS_FILE=str(path))
    try:
        for endpoint in ("mesh", "series", "requests", "requests/x"):
            assert get(f"{url}/v1/dashboard/{endpoint}")[0] == 401
            assert get(f"{url}/v1/dashboard/{endpoint}", user)[0] == 403
        assert get(f"{url}/v1/dashboard/mesh", admin)[0] == 200
        assert get(f"{url}/v1/dashboard/requests/nope", admin)[0] == 404
        status, page = get(f"{url}/dashboard")  # the page holds no figures: it asks for a key
        assert status == 200 and "Admin key" in page
    finally:
        stack.procs["router-api-keys"].stop()
