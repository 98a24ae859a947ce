"""The lab's views in a real browser: JupyterLab on 127.0.0.1 with a token, Debian's Chromium
driven by Python playwright (no browser download: ``executable_path=/usr/bin/chromium``).

For each of notebooks 02-04 and 09: open a working copy (the tracked notebooks are never touched),
run all cells, then check the view's widgets react as they should, and save screenshots under
``tests/output/browser/`` (ignored by git).

* 02 verify stepper: pressing "next decision" changes the highlighted node and the verdict;
  the what-if slider's first stops are inside the root's narrow segments, its answer appears
  beside it and the what-if walk is drawn on the tree (issue 18.5); at a leaf's bonus only the
  final coin is shown and no mass above 1 (18.2); End on the step slider after switching
  request goes to that request's last step (18.9).
* 03 greedy vs sampling: the plotly figures render.
* 04 tuner: moving the top-p slider changes the displayed expected τ, and it equals
  :func:`ddtree_lab.views.tuner.expected_tau_text` for the controls' values; moving the step
  slider alone moves the per-step chart's selected bar, and the request dropdown picks the
  request (18.1).
* 09 vLLM engine: both runs' texts side by side, the applied-parameters figures drawn with a log
  y axis, the stepper on the fixed run steps, the tree drawn, the shipped run's findings table
  names the engine-parameters bug and the fixed run's says there are none.

And without Jupyter: ``ddtree-lab audit --plot`` writes a page that draws with every network
request blocked (18.12), where a CDN page stays blank; and each of the DDTree reference's dumps
under fixtures/ddtree_reference/ is drawn by ``ddtree-lab render`` and by the stepper's HTML on a
page where every tree node and the note naming what the dump does not record are visible
(issue 26).

Without Chromium or playwright the test fails when ``CI`` is set and is skipped otherwise
(with the reason). A notebook not written yet is skipped with its name.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LABS = ROOT / "labs"
OUTPUT = ROOT / "tests" / "output" / "browser"
CHROMIUM = os.environ.get("DDTREE_LAB_CHROMIUM", "/usr/bin/chromium")
NOTEBOOKS = ["02_verify_stepper.ipynb", "03_greedy_vs_sampling.ipynb", "04_topk_topp_tuner.ipynb",
             "09_vllm_engine.ipynb"]
CELL_TIMEOUT_MS = 600_000

pytestmark = pytest.mark.slow


def missing_browser() -> str | None:
    if not Path(CHROMIUM).exists():
        return f"Chromium not found at {CHROMIUM} (apt-get install chromium; scripts/setup.sh does it as root)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Python playwright is not installed (pip install playwright; it is in the dev extra)"
    return None


def _require_browser() -> None:
    why = missing_browser()
    if why is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"browser test cannot run in CI: {why}")
    pytest.skip(why)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory):
    """JupyterLab serving a copy of labs/ on 127.0.0.1:PORT with a random token."""
    _require_browser()
    # The copies sit in a labs/ folder beside links to the repo's fixtures and benchmarks, so paths
    # relative to labs/ (e.g. "../fixtures/traces/...") resolve as they do in the repo and in `make lab`.
    base = tmp_path_factory.mktemp("lab")
    work = base / "labs"
    work.mkdir()
    (base / "fixtures").symlink_to(ROOT / "fixtures", target_is_directory=True)
    (base / "benchmarks").symlink_to(ROOT / "benchmarks", target_is_directory=True)  # notebook 04's panels
    for nb in LABS.glob("*.ipynb"):
        shutil.copy(nb, work / nb.name)
    token, port = secrets.token_hex(16), _free_port()
    # Render every cell (JupyterLab 4 otherwise renders only the cells in view), no news pop-up.
    settings = base / ".settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", JUPYTERLAB_SETTINGS_DIR=str(base / ".settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(base / ".workspaces"), JUPYTER_TOKEN=token)  # not in argv (ps)
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           f"--ServerApp.root_dir={work}",
           "--LabApp.news_url=", f"--LabApp.workspaces_dir={base / '.workspaces'}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(base / "jupyter.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2).read()
            break
        except OSError as exc:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"JupyterLab did not start: {(base / 'jupyter.log').read_text()[-2000:]}") from exc
            time.sleep(0.5)
    yield {"url": url, "token": token, "dir": work}
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture(scope="module")
def browser():
    _require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--disable-dev-shm-usage"])
        yield b
        b.close()


def run_notebook_in_browser(browser, server, name: str, width: int = 1280, height: int = 2000):
    """Open notebook ``name`` in JupyterLab, run all cells, wait until the kernel is idle with
    no cell left to run; returns the playwright page. Fails naming the first cell error."""
    page = browser.new_page(viewport={"width": width, "height": height})
    page.set_default_timeout(120_000)
    page.goto(f"{server['url']}/lab/tree/{name}?reset&token={server['token']}")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
    dialog = page.locator(".jp-Dialog .jp-mod-accept")
    try:  # a "Select Kernel" dialog on first open
        dialog.first.click(timeout=5_000)
    except Exception:
        pass
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle'], "
                           ".jp-Toolbar-kernelStatus", timeout=120_000)
    try:  # the "Jupyter news" question, out of the way of screenshots
        page.locator(".jp-toast-button", has_text=re.compile(r"^No$")).first.click(timeout=3_000)
    except Exception:
        pass
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
    panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")  # this notebook's tab only
    errors = panel.locator("[data-mime-type='application/vnd.jupyter.stderr']",
                           has_text=re.compile(r"Traceback|Error"))
    deadline = time.time() + CELL_TIMEOUT_MS / 1000
    while time.time() < deadline:  # every code cell has run once no prompt shows [*] or [ ]
        if errors.count():  # a failing cell stops Run All: report it at once
            screenshot(page, f"{name.removesuffix('.ipynb')}_error")
            pytest.fail(f"{name}: a cell raised: {errors.first.inner_text()[:2000]}")
        prompts = panel.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()
        if prompts and all(re.fullmatch(r"\[\d+\]:", p.strip()) for p in prompts):
            break
        page.wait_for_timeout(500)
    else:
        screenshot(page, f"{name.removesuffix('.ipynb')}_timeout")
        pytest.fail(f"{name}: cells still running after {CELL_TIMEOUT_MS / 1000:.0f} s (prompts {prompts})")
    if errors.count():
        pytest.fail(f"{name}: a cell raised: {errors.first.inner_text()[:2000]}")
    return page


def screenshot(page, name: str, locator=None) -> Path:
    """Save a screenshot (of ``locator`` when given) under tests/output/browser/."""
    OUTPUT.mkdir(parents=True, exist_ok=True)
    path = OUTPUT / f"{name}.png"
    (locator or page).screenshot(path=str(path))
    return path


def _highlighted(stepper) -> str | None:
    """The SVG node the stepper highlights (filled yellow): its graphviz title, e.g. ``n3``."""
    return stepper.evaluate("""el => {
        for (const g of el.querySelectorAll('.ddtree-picture g.node')) {
            const shape = g.querySelector('path, polygon, ellipse');
            if (shape && (shape.getAttribute('fill') || '').toLowerCase() === '#fff59d')
                return g.querySelector('title').textContent;
        }
        return null; }""")


def _wait_for_change(page, locator, before: str, timeout_s: float = 60.0) -> str:
    """Poll ``locator``'s text until it differs from ``before`` (widgets re-render their HTML,
    so a held element handle would go stale)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        now = locator.inner_text()
        if now != before:
            return now
        page.wait_for_timeout(200)
    pytest.fail(f"the text stayed {before!r} for {timeout_s:.0f} s")


def _number(x: float) -> str:
    from ddtree_lab.views.labels import number_label

    return number_label(x)


def _press(page, locator, key: str, times: int = 1) -> None:
    locator.focus()
    for _ in range(times):
        page.keyboard.press(key)


def _drag(page, slider, dx: float) -> dict:
    """Drag ``slider``'s handle (``slider``: a locator of the slider widget) by ``dx`` px with
    the mouse, as a user does: press on the handle, move in steps, release. Returns the track's
    bounding box after asserting it is wide enough to drag on (issue 34.2: a slider squeezed
    to its description and readout had a 0 px track: the readout showed, the handle did not move)."""
    track = slider.locator(".noUi-target").first
    handle = slider.locator(".noUi-handle").first
    handle.scroll_into_view_if_needed()
    tbox = track.bounding_box()
    assert tbox is not None and tbox["width"] > 50, f"slider track {tbox} (0 px: not draggable)"
    box = handle.bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    page.mouse.down()
    page.mouse.move(x + dx / 2, y, steps=5)
    page.mouse.move(x + dx, y, steps=5)
    page.mouse.up()
    return tbox


def _wait_for(page, predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if predicate():
            return
        page.wait_for_timeout(200)
    pytest.fail(f"{what}: not so after {timeout_s:.0f} s")


def _nothing_clipped(locator) -> dict:
    """Layout of ``locator``'s element: its box, and whether its content is wider than it is
    (scrollWidth > clientWidth: text or a picture cut off at the right)."""
    return locator.evaluate("""el => { const r = el.getBoundingClientRect();
        return {left: r.left, right: r.right, width: r.width, height: r.height,
                scrollWidth: el.scrollWidth, clientWidth: el.clientWidth}; }""")


def _row_fits(row) -> None:
    """Every control of the flex row ``row`` ends inside it and shows whole (issue 34.8)."""
    rbox = _nothing_clipped(row)
    children = row.locator(":scope > *")
    for k in range(children.count()):
        child = _nothing_clipped(children.nth(k))
        assert child["right"] <= rbox["right"] + 1 and child["scrollWidth"] <= child["clientWidth"] + 1, (k, child, rbox)


def check_02_drag_sliders(page, stepper) -> None:
    """Issue 34.2: every slider of the stepper has a track and follows a mouse drag: the step
    slider moves the step on show (the tree's title names it), the decision slider the verdict's
    decision, the what-if slider its answer."""
    run = _fixture_run()
    request = 1
    steps = run.for_request(request)
    stepper.locator("select").first.select_option(label=f"request {steps[0].request_id}")
    _wait_for(page, lambda: _readout(stepper, "ddtree-step") == "0", f"request {request}'s first step")
    for k in range(3):  # the rows of controls: request / step, decision buttons, what-if
        _row_fits(stepper.locator(".widget-hbox").nth(k))
    step_slider = stepper.locator(".ddtree-step").first
    before = 0
    _drag(page, step_slider, 60)
    _wait_for(page, lambda: int(_readout(stepper, "ddtree-step")) > before, "the step slider's readout moved")
    page.wait_for_timeout(500)
    position = int(_readout(stepper, "ddtree-step"))
    want = f"step {steps[position].step} · request {steps[position].request_id}"
    _wait_for(page, lambda: want in stepper.locator(".ddtree-picture svg").first.inner_html(),
              f"the tree shows {want!r} after dragging the step slider to {position}")
    verdict = stepper.locator(".ddtree-verdict")
    decision = stepper.locator(".ddtree-decision").first
    _drag(page, decision, 80)
    _wait_for(page, lambda: int(_readout(stepper, "ddtree-decision")) > 0, "the decision slider moved")
    page.wait_for_timeout(500)
    k = int(_readout(stepper, "ddtree-decision"))
    _wait_for(page, lambda: verdict.inner_text().startswith(f"decision {k} /"),
              f"the verdict shows decision {k} after the drag")
    stepper.locator(".ddtree-first button, button.ddtree-first").first.click()
    _wait_for(page, lambda: verdict.inner_text().startswith("decision 0 /"), "back at decision 0")
    coin = stepper.locator(".ddtree-coin-slider").first
    answer = stepper.locator(".ddtree-whatif").first
    old_readout, old = _readout(stepper, "ddtree-coin-slider"), answer.inner_text()
    moved = lambda: _readout(stepper, "ddtree-coin-slider") != old_readout and answer.inner_text() != old
    _drag(page, coin, -250)  # towards the first stops; where the recorded coin is the lowest, the other way
    page.wait_for_timeout(2000)
    if not moved():
        _drag(page, coin, 250)
    _wait_for(page, moved, "the what-if slider's readout and answer moved")
    assert "what-if u=" in answer.inner_text()
    screenshot(page, "02_dragged_sliders", stepper)


def check_params_are_text(page) -> None:
    """Issue 34.8: the run summary table shows the parameters as the lab's label, not a dict."""
    summary = page.locator(".jp-OutputArea-output table").first
    summary.wait_for()
    text = summary.inner_text()
    assert "params" in text and "T=0.8" in text and "{" not in text and "'temperature'" not in text, text


def check_02(page) -> None:
    """Verify stepper: "next decision" changes the highlighted node and the verdict text; the
    what-if, the leaf bonus and the step slider after a request switch (issue 18.2, 5, 9)."""
    stepper = page.locator(".ddtree-stepper").first
    stepper.wait_for()
    stepper.scroll_into_view_if_needed()
    verdict = stepper.locator(".ddtree-verdict")
    seen = []
    for _ in range(3):
        before = verdict.inner_text()
        stepper.locator(".ddtree-next button, button.ddtree-next").first.click()
        _wait_for_change(page, verdict, before)
        # the verdict's HTML lands before the picture's (two widget messages): wait for the picture too
        deadline = time.time() + 10
        while _highlighted(stepper) in [n for n, _ in seen] and time.time() < deadline:
            page.wait_for_timeout(200)
        seen.append((_highlighted(stepper), verdict.inner_text()))
    nodes, verdicts = [s[0] for s in seen], [s[1] for s in seen]
    assert all(nodes) and len(set(nodes)) == 3, nodes
    assert len(set(verdicts)) == 3, verdicts
    ks = [int(re.match(r"decision (\d+) /", v).group(1)) for v in verdicts]
    assert ks == [ks[0], ks[0] + 1, ks[0] + 2], verdicts
    check_02_what_if(page, stepper)
    check_02_leaf_bonus(page, stepper)
    check_02_step_slider_after_request_switch(page, stepper)
    check_02_drag_sliders(page, stepper)
    check_params_are_text(page)


def _fixture_run():
    import ddtree_lab as dl

    return dl.load_trace(ROOT / "fixtures" / "traces" / "smollm2_t08_b32.ddtrace.safetensors")


def check_02_what_if(page, stepper) -> None:
    """Issue 18.5: at the root (request 1, position 2 of the fixture) the slider's first stop
    lies in the first child's segment (far below 0.001), the answer is beside the slider and a
    different what-if path is drawn in purple on the tree."""
    from ddtree_lab import views

    verdict = stepper.locator(".ddtree-verdict")
    before = verdict.inner_text()
    stepper.locator(".ddtree-first button, button.ddtree-first").first.click()
    _wait_for_change(page, verdict, before)
    answer = stepper.locator(".ddtree-whatif").first
    handle = stepper.locator(".ddtree-coin-slider .noUi-handle").first
    step = _fixture_run().for_request(1)[2]
    segs = views.html.segments(views.step_view(step), 0)
    c, lo, hi = next((c, lo, hi) for c, lo, hi in segs if hi > lo)
    old = answer.inner_text()
    _press(page, handle, "Home")
    text = _wait_for_change(page, answer, old)
    readout = stepper.locator(".ddtree-coin-slider .widget-readout").first.inner_text().strip()
    assert readout == f"#{c}", readout
    u = float(re.search(r"what-if u=([0-9.e-]+)", text).group(1))
    assert lo <= u < hi and hi < 0.01, (u, lo, hi)  # a narrow segment, reached by one key press
    box_a, box_s = answer.bounding_box(), handle.bounding_box()
    assert abs(box_a["y"] - box_s["y"]) < 80, (box_a, box_s)  # beside the control, not 700 px below
    for _ in range(len(segs) + 2):  # step right until the walk leaves the recorded path
        if "different path" in answer.inner_text():
            break
        old = answer.inner_text()
        _press(page, handle, "ArrowRight")
        _wait_for_change(page, answer, old)
    assert "different path" in answer.inner_text()
    page.wait_for_timeout(500)
    svg = stepper.locator(".ddtree-picture svg").first.inner_html()
    assert "#6a1b9a" in svg and "what-if walk" in svg  # the what-if walk on the tree
    screenshot(page, "02_verify_stepper_what_if", stepper)


def check_02_leaf_bonus(page, stepper) -> None:
    """Issue 18.2: at the bonus of a leaf only the final coin shows (not the leaf's own,
    unused coin), the what-if slider is off, and no mass above 1 is printed."""
    step = _fixture_run().for_request(1)[2]
    assert step.bonus.kind == "leaf"
    verdict = stepper.locator(".ddtree-verdict")
    before = verdict.inner_text()
    stepper.locator(".ddtree-last button, button.ddtree-last").first.click()
    _wait_for_change(page, verdict, before)
    page.wait_for_timeout(500)
    leaf = step.bonus.node
    final, unused = _number(float(step.final_coin)), _number(float(step.coins[leaf]))
    text = stepper.inner_text()
    assert f"final coin u={final}" in verdict.inner_text()
    assert stepper.locator(".ddtree-massbar-leaf").count() == 1 and stepper.locator(".ddtree-coin").count() == 0
    assert re.search(re.escape(f"u={unused}") + r"(?![0-9])", text) is None, unused
    assert "is a leaf" in stepper.locator(".ddtree-whatif").first.inner_text()
    for mass in re.findall(r"mass ([0-9][0-9.e-]*)", text):
        assert float(mass) <= 1.0, mass
    screenshot(page, "02_verify_stepper", stepper)


def check_02_step_slider_after_request_switch(page, stepper) -> None:
    """Issue 18.9: after picking another request, End on the step slider goes to its last step."""
    run = _fixture_run()
    last = len(run.for_request(2)) - 1
    assert last != len(run.for_request(1)) - 1
    verdict = stepper.locator(".ddtree-verdict")
    before = verdict.inner_text()
    stepper.locator("select").first.select_option(label=f"request {run.for_request(2)[0].request_id}")
    _wait_for_change(page, verdict, before)
    page.wait_for_timeout(500)
    readout = stepper.locator(".ddtree-step .widget-readout").first
    _press(page, stepper.locator(".ddtree-step .noUi-handle").first, "End")
    deadline = time.time() + 30
    while readout.inner_text().strip() != str(last) and time.time() < deadline:
        page.wait_for_timeout(200)
    assert readout.inner_text().strip() == str(last)


def check_03(page) -> None:
    """Greedy vs sampling: the plotly figures render (the notebook's own checks run in its cells)."""
    page.wait_for_selector(".js-plotly-plot", timeout=60_000)
    assert page.locator(".js-plotly-plot").count() >= 1
    screenshot(page, "03_greedy_vs_sampling", page.locator(".js-plotly-plot").first)
    trees = page.locator(".ddtree-trees").first  # issue 18.7: trees at their own size, scrolling
    trees.scroll_into_view_if_needed()
    svg = trees.locator("svg").first
    drawn = svg.bounding_box()["width"]
    natural = float(re.search(r"([0-9.]+)pt", svg.get_attribute("width")).group(1)) * 4 / 3
    assert abs(drawn - natural) < 2, (drawn, natural)
    screenshot(page, "03_trees", trees)


def _readout(container, cls: str) -> str:
    return container.locator(f".{cls} .widget-readout").first.inner_text().strip()


def expected_tau_for(controls: dict) -> str:
    """The library's mean expected τ of notebook 04's recorded run at the tuner's control
    values, as the tuner prints it (:func:`ddtree_lab.views.tuner.expected_tau_text`)."""
    import ddtree_lab as dl
    from ddtree_lab.views.tuner import expected_tau_text, params_from_controls

    run = dl.load_trace(ROOT / "fixtures" / "traces" / "smollm2_t08_b32.ddtrace.safetensors")
    params = params_from_controls(controls["temperature"], controls["top_k"], controls["top_p"], controls["min_p"])
    return expected_tau_text(run, params, controls["budget"])


def check_04(page) -> None:
    """Tuner: move the top-p slider; the displayed expected τ (accepted draft tokens + 1)
    equals what the library computes for that setting."""
    shown = page.locator(".ddtree-expected-tau").first
    shown.wait_for()
    shown.scroll_into_view_if_needed()
    before = shown.inner_text().strip()
    top_p_before = float(_readout(page, "ddtree-tuner-top-p"))
    page.locator(".ddtree-tuner-top-p .noUi-handle").first.focus()
    page.keyboard.press("ArrowLeft")
    page.keyboard.press("ArrowLeft")
    after = _wait_for_change(page, shown, before).strip()
    controls = {"temperature": float(_readout(page, "ddtree-tuner-temperature")),
                "top_k": int(_readout(page, "ddtree-tuner-top-k")),
                "top_p": float(_readout(page, "ddtree-tuner-top-p")),
                "min_p": float(_readout(page, "ddtree-tuner-min-p")),
                "budget": int(_readout(page, "ddtree-tuner-budget"))}
    assert controls["top_p"] == pytest.approx(top_p_before - 0.10, abs=1e-6), controls
    page.wait_for_timeout(1000)  # let any later update land, then read the settled value
    after = shown.inner_text().strip()
    assert after == expected_tau_for(controls), (after, controls)
    check_04_step_controls(page)
    check_04_tree_scrolls_in_its_own_box(page)
    check_04_idle_sliders_are_off_with_a_note(page)
    check_04_drag_sliders(page)
    check_04_chart_fonts(page)
    check_04_policy_picker(page)
    screenshot(page, "04_topk_topp_tuner", page.locator(".ddtree-expected-tau").first.locator(
        "xpath=ancestor::div[contains(@class, 'widget-vbox')][last()]"))


def _controls(page) -> dict:
    return {"temperature": float(_readout(page, "ddtree-tuner-temperature")),
            "top_k": int(_readout(page, "ddtree-tuner-top-k")),
            "top_p": float(_readout(page, "ddtree-tuner-top-p")),
            "min_p": float(_readout(page, "ddtree-tuner-min-p")),
            "budget": int(_readout(page, "ddtree-tuner-budget"))}


def check_04_drag_sliders(page) -> None:
    """Issue 34.2: each of the tuner's sliders has a track and follows a mouse drag: its value
    moves, and the expected τ shown is the library's for the new values; dragging the step
    slider moves the per-step chart's selected bar to the step it names."""
    shown = page.locator(".ddtree-expected-tau").first
    for cls, dx in (("temperature", -30), ("top-k", 40), ("top-p", -40), ("min-p", 20), ("budget", -60)):
        before = _readout(page, f"ddtree-tuner-{cls}")
        _drag(page, page.locator(f".ddtree-tuner-{cls}").first, dx)
        _wait_for(page, lambda: _readout(page, f"ddtree-tuner-{cls}") != before, f"{cls} moved by a drag")
        page.wait_for_timeout(500)
        controls = _controls(page)
        _wait_for(page, lambda: shown.inner_text().strip() == expected_tau_for(controls),
                  f"the expected τ after dragging {cls} ({controls}) is the library's {expected_tau_for(controls)}")
    run = _fixture_run()
    before = _selected_bar(page)
    _drag(page, page.locator(".ddtree-tuner-step").first, 50)

    def moved() -> bool:
        k, position = _selected_bar(page), int(_readout(page, "ddtree-tuner-step"))
        steps = run.for_request(run.steps[k].request)
        return k != before and position < len(steps) and steps[position] is run.steps[k]

    _wait_for(page, moved, "the step slider's drag moved the selected bar to its step")
    screenshot(page, "04_dragged_sliders", page.locator(".ddtree-expected-tau").first.locator(
        "xpath=ancestor::div[contains(@class, 'widget-vbox')][last()]"))


def check_04_chart_fonts(page) -> None:
    """Issue 34.8: the tuner's charts and the notebook's plotly figures draw text of 12 px or more."""
    for svg in ("svg.ddtree-tuner-per-step", "svg.ddtree-tuner-cover"):
        sizes = page.locator(svg).first.evaluate(
            "el => [...el.querySelectorAll('text')].map(t => parseFloat(getComputedStyle(t).fontSize))")
        assert sizes and min(sizes) >= 12, (svg, sizes)
    page.wait_for_selector(".js-plotly-plot", timeout=60_000)
    for k in range(page.locator(".js-plotly-plot").count()):
        sizes = page.locator(".js-plotly-plot").nth(k).evaluate(
            "el => [...el.querySelectorAll('.xtick text, .ytick text, .legendtext, .g-xtitle text, .g-ytitle text')]"
            ".map(t => parseFloat(t.style.fontSize || getComputedStyle(t).fontSize))")
        assert sizes and min(sizes) >= 12, (k, sizes)


def check_04_policy_picker(page) -> None:
    """Issue 34.8: the policy picker's controls all show whole (nothing cut at the right), its
    trees sit at their own size (none clipped, no empty height below one), the budget and step
    sliders follow a mouse drag, and picking the chain says why it has 15 nodes at B >= 16."""
    picker = page.locator(".ddtree-policy-picker").first
    picker.scroll_into_view_if_needed()
    _row_fits(picker.locator(".widget-hbox").first)
    select = _nothing_clipped(picker.locator("select").first)
    assert select["scrollWidth"] <= select["clientWidth"] + 1, select
    summary = picker.locator(".widget-html").first
    picker.locator("select").first.select_option("chain")
    _wait_for(page, lambda: summary.inner_text().startswith("chain at B ="), "the chain picked")
    budget = picker.locator(".ddtree-policy-budget").first
    before = _readout(picker, "ddtree-policy-budget")
    _drag(page, budget, -80)
    _wait_for(page, lambda: _readout(picker, "ddtree-policy-budget") != before, "the picker's budget moved by a drag")
    b = int(_readout(picker, "ddtree-policy-budget"))
    _wait_for(page, lambda: summary.inner_text().startswith(f"chain at B = {b}:"), f"the summary says B = {b}")
    if b >= 16:
        assert "at most 15 nodes" in summary.inner_text() and "L-1 = 15" in summary.inner_text(), summary.inner_text()
    trees = picker.locator(".ddtree-policy-trees").first
    old = trees.inner_html()
    _drag(page, picker.locator(".ddtree-policy-step").first, 60)
    _wait_for(page, lambda: _readout(picker, "ddtree-policy-step") != "0" and trees.inner_html() != old,
              "the picker's step slider moved by a drag and the trees changed")
    page.wait_for_timeout(500)
    tbox = _nothing_clipped(trees)
    cells = trees.locator(".ddtree-policy-tree")
    assert cells.count() == 2
    for k in range(cells.count()):
        cell = _nothing_clipped(cells.nth(k))
        svg = _nothing_clipped(cells.nth(k).locator("svg").first)
        fits = cell["scrollWidth"] <= cell["clientWidth"] + 1
        assert fits or cell["width"] >= tbox["width"] - 2, (k, cell, tbox)  # clipped only when wider than the page
        assert cell["right"] <= tbox["right"] + 1, (k, cell, tbox)
        assert cell["height"] - svg["height"] < 30, (k, cell, svg)  # no empty height below a short tree
    screenshot(page, "04_policy_picker", picker)


def _selected_bar(page) -> int:
    return int(page.locator("svg.ddtree-tuner-per-step").first.get_attribute("data-selected"))


def check_04_step_controls(page) -> None:
    """Issue 18.1: the step slider alone moves the per-step chart's selected bar to the step
    the tree shows; the request dropdown picks the request, the slider its steps."""
    run = _fixture_run()
    before = _selected_bar(page)
    handle = page.locator(".ddtree-tuner-step .noUi-handle").first
    _press(page, handle, "ArrowRight", 3)
    deadline = time.time() + 60

    def settled() -> bool:  # each key press redraws the chart: wait for the last one to land
        k = _selected_bar(page)
        position = int(_readout(page, "ddtree-tuner-step"))
        steps = run.for_request(run.steps[k].request)
        return k != before and position < len(steps) and steps[position] is run.steps[k]

    while not settled() and time.time() < deadline:
        page.wait_for_timeout(200)
    position = int(_readout(page, "ddtree-tuner-step"))
    k = _selected_bar(page)
    request = run.steps[k].request
    assert run.for_request(request)[position] is run.steps[k], (position, k)
    assert f"step {run.steps[k].step} of request {run.steps[k].request_id}" in \
        page.locator("svg.ddtree-tuner-per-step").first.inner_html()
    page.locator(".ddtree-tuner-request select").first.select_option(label=f"request {run.for_request(2)[0].request_id}")
    deadline = time.time() + 60
    while run.steps[_selected_bar(page)].request != 2 and time.time() < deadline:
        page.wait_for_timeout(200)
    assert run.steps[_selected_bar(page)] is run.for_request(2)[0] and _readout(page, "ddtree-tuner-step") == "0"


def check_04_tree_scrolls_in_its_own_box(page) -> None:
    """Issue 26.10: the selected step's tree scrolls in its own box, which stays inside the
    page (the tree was clipped at 1,100 px with the only scrollbar under the whole tuner)."""
    box = page.locator(".ddtree-tuner-tree").first
    box.scroll_into_view_if_needed()
    got = box.evaluate("""el => {
        const r = el.getBoundingClientRect(), svg = el.querySelector('svg').getBoundingClientRect();
        const style = getComputedStyle(el), out = {overflow: style.overflowY + ' ' + style.overflowX,
            maxHeight: style.maxHeight, right: r.right, height: r.height, svgHeight: svg.height,
            page: document.documentElement.clientWidth};
        // the selected step's tree may fit: make it taller than its box, as a deep tree is
        const tall = el.querySelector('svg'); tall.style.height = Math.max(2 * r.height, 1500) + 'px';
        const before = el.scrollTop; el.scrollTop = 200;
        out.over = el.scrollHeight > el.clientHeight; out.moved = el.scrollTop > before;
        out.boxAfter = el.getBoundingClientRect().height; tall.style.height = '';
        return out; }""")
    assert got["overflow"].startswith("auto") and got["maxHeight"] == "720px", got
    assert got["over"] and got["moved"] and got["boxAfter"] <= 722, got  # a tall tree scrolls inside its box
    assert got["right"] <= got["page"] + 1 and got["height"] <= 722, got  # and the box stays on the page
    screenshot(page, "04_tuner_tree_box", box)


def check_04_idle_sliders_are_off_with_a_note(page) -> None:
    """Issue 26.12: at top-k = 1 temperature, top-p and min-p change nothing: they are off and
    a note beside them says why; top-k back to 0 turns them on again."""
    note = page.locator(".ddtree-tuner-params-note").first
    handle = page.locator(".ddtree-tuner-top-k .noUi-handle").first
    _press(page, handle, "Home")
    _press(page, handle, "ArrowRight")
    deadline = time.time() + 60
    while "top-k = 1" not in note.inner_text() and time.time() < deadline:
        page.wait_for_timeout(200)
    assert "top-k = 1" in note.inner_text() and "change nothing" in note.inner_text()
    for name in ("temperature", "top-p", "min-p"):
        assert page.locator(f".ddtree-tuner-{name} [disabled]").count() >= 1, name
    assert page.locator(".ddtree-tuner-top-k [disabled]").count() == 0
    screenshot(page, "04_tuner_top_k_1", note.locator("xpath=ancestor::div[contains(@class, 'widget-vbox')][1]"))
    _press(page, handle, "Home")
    deadline = time.time() + 60
    while note.inner_text().strip() and time.time() < deadline:
        page.wait_for_timeout(200)
    assert not note.inner_text().strip() and page.locator(".ddtree-tuner-temperature [disabled]").count() == 0


def check_09(page) -> None:
    """vLLM engine: the texts table has a row per request and a column per run, both figures draw
    (log y: the shipped sampler's temperatures span 1e-41 .. 1e24), "next" on the stepper moves its
    verdict, the tree is drawn, the findings tables say what diagnose found on each run."""
    texts = page.locator("table.ddtree-generated").first
    texts.wait_for()
    assert texts.locator("tr").count() == 4 and texts.locator("th").count() == 3
    assert "The bicycle stays upright" in texts.inner_text()
    page.wait_for_selector(".js-plotly-plot", timeout=60_000)
    plots = page.locator(".js-plotly-plot")
    assert plots.count() == 2
    first = plots.first
    first.scroll_into_view_if_needed()
    ticks = " ".join(first.locator(".ytick text").all_text_contents())
    assert "10" in ticks and first.locator(".scatterlayer .trace").count() >= 3, ticks
    screenshot(page, "09_applied_parameters", first)
    stepper = page.locator(".ddtree-stepper").first
    stepper.scroll_into_view_if_needed()
    verdict = stepper.locator(".ddtree-verdict")
    before = verdict.inner_text()
    stepper.locator(".ddtree-next button, button.ddtree-next").first.click()
    assert re.match(r"decision \d+ /", _wait_for_change(page, verdict, before))
    screenshot(page, "09_stepper", stepper)
    tree = page.locator(".jp-OutputArea-output[data-mime-type='image/svg+xml']").first  # the step's whole tree
    tree.scroll_into_view_if_needed()
    box = tree.bounding_box()
    assert box is not None and box["width"] > 200 and box["height"] > 50, box
    screenshot(page, "09_tree", tree)
    findings = page.locator("table.ddtree-findings").first
    findings.scroll_into_view_if_needed()
    assert findings.locator("tr").count() == 4 and "engine-parameters" in findings.inner_text()
    assert "no findings" in page.locator("p.ddtree-findings").first.inner_text()
    screenshot(page, "09_findings", findings)


CHECKS = {"02_verify_stepper.ipynb": check_02, "03_greedy_vs_sampling.ipynb": check_03,
          "04_topk_topp_tuner.ipynb": check_04, "09_vllm_engine.ipynb": check_09}


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_view_in_browser(name, lab_server, browser):
    if not (LABS / name).exists():
        pytest.skip(f"labs/{name} is not written yet")
    page = run_notebook_in_browser(browser, lab_server, name)
    try:
        CHECKS[name](page)
    finally:
        screenshot(page, f"{name.removesuffix('.ipynb')}_page")
        page.close()


def test_audit_plot_draws_offline(browser, tmp_path):
    """Issue 18.12: the page ``audit --plot`` writes draws its bars with every network request
    blocked (plotly.js is inside it). The control, a bare page (not one the lab writes) whose only
    script comes from the network, shows the block works: its script never runs."""
    from ddtree_lab.cli import main

    plot = tmp_path / "audit.html"
    assert main(["audit", "--random", "1", "--draws", "300", "--plot", str(plot)]) == 0
    control = tmp_path / "control.html"
    control.write_text('<html><body><script src="https://network.invalid/probe.js"></script>'
                       '<div class="js-plotly-plot"></div></body></html>')
    drawn = {}
    for name, path in (("embedded", plot), ("control", control)):
        page = browser.new_page(viewport={"width": 1000, "height": 600})
        blocked = []
        page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                   else (blocked.append(route.request.url), route.abort()))
        page.goto(path.as_uri())
        page.wait_for_timeout(3000)
        drawn[name] = (page.locator(".js-plotly-plot .main-svg").count(), page.locator(".js-plotly-plot .point").count(),
                       list(blocked))
        if name == "embedded":
            screenshot(page, "audit_plot_offline")
        page.close()
    assert drawn["embedded"][0] > 0 and drawn["embedded"][1] > 0 and not drawn["embedded"][2], drawn
    assert drawn["control"][0] == 0 and any("network.invalid" in u for u in drawn["control"][2]), drawn


def test_byte_tokens_and_shared_texts_draw_apart_in_the_browser(browser, tmp_path):
    """Issue 26.2: the stepper's tree and tables as Chromium draws them: byte tokens show as
    ``<0xE3>`` escapes with their id, and two tokens recorded with the same ``'�'`` text (an
    older recording) are told apart by their ids."""
    import dataclasses

    from ddtree_lab import views

    run = _fixture_run()
    step = next(s for s in run.steps if s.accept_length >= 1 and any(
        d.verdict == "reject" and d.parent == 0 for d in s.decisions))
    tokens = step.node_token_ids.tolist()
    accepted = tokens[step.accepted_path[1]]
    rejected = next(d.token for d in step.decisions if d.verdict == "reject" and d.parent == 0 and d.token != accepted)
    other = next(t for t in tokens[1:] if t not in (accepted, rejected))
    texts = dict(run.token_texts)
    texts.update({accepted: "\ufffd", rejected: "\ufffd", other: "<0xE3><0x81>"})
    run = dataclasses.replace(run, token_texts=texts)
    stepper = views.VerifyStepper(run, request=step.request, step=run.for_request(step.request).index(step),
                                  collapse_unvisited=False)
    stepper.go(stepper.num_events)
    page_file = tmp_path / "labels.html"
    page_file.write_text(f'<html><meta charset="utf-8"><body>{stepper.picture_svg()}{stepper.details_html()}'
                         f"{views.decisions_table_html(stepper.view)}</body></html>", encoding="utf-8")
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto(page_file.as_uri())
        svg_text = " ".join(page.locator("svg g.node text").all_text_contents())
        table_text = page.locator("table.ddtree-decisions").first.inner_text()
        screenshot(page, "token_labels")
    finally:
        page.close()
    for shown in (svg_text, table_text):
        assert f"'�' id {accepted}" in shown and f"'�' id {rejected}" in shown, shown[:500]
    assert f"'<0xE3><0x81>' id {other}" in svg_text
    bare = svg_text.replace(f"'�' id {accepted}", "").replace(f"'�' id {rejected}", "")
    assert "'�'" not in bare


REFERENCE_DUMPS = sorted((ROOT / "fixtures" / "ddtree_reference").glob("*.*"))


@pytest.mark.parametrize("dump", REFERENCE_DUMPS, ids=lambda p: p.name)
def test_reference_dump_step_drawn_in_browser(dump, browser, tmp_path):
    """Issue 26: a DDTree reference dump's step (no target rows, coins or decision log) in the
    HTML view: the picture ``render`` writes and the stepper's picture, verdict and details on one
    page. Every tree node and the bonus are drawn and visible, the accepted path is green, and
    the note saying what is missing is visible both in the picture and as the page's note."""
    from ddtree_lab.cli import main
    from ddtree_lab.io import load
    from ddtree_lab.views import VerifyStepper

    run = load(dump)
    step = run.steps[0]
    svg_path = tmp_path / "step.svg"
    assert main(["render", str(dump), "--step", str(step.step), "--request", str(step.request), "-o", str(svg_path)]) == 0
    stepper = VerifyStepper(run, request=step.request)
    page_html = tmp_path / "step.html"
    page_html.write_text(f"<html><body><div class='rendered'>{svg_path.read_text(encoding='utf-8')}</div>"
                         f"{stepper.verdict_html()}<div class='stepper'>{stepper.picture_svg()}</div>"
                         f"{stepper.details_html()}</body></html>", encoding="utf-8")
    page = browser.new_page(viewport={"width": 1800, "height": 1400})
    try:
        page.goto(page_html.as_uri())
        drawn = page.locator(".rendered svg g.node")
        bonus = ["bonus"] if step.bonus_token >= 0 else []  # a fork's dump without output_ids has no bonus token
        assert drawn.count() == step.num_nodes + len(bonus)  # every tree node and the bonus
        for k in range(drawn.count()):
            box = drawn.nth(k).bounding_box()
            assert box is not None and box["width"] > 0 and box["height"] > 0, k
        titles = [drawn.nth(k).locator("title").text_content() for k in range(drawn.count())]
        assert sorted(titles) == sorted([f"n{i}" for i in range(step.num_nodes)] + bonus)
        accepted = page.locator('.rendered svg g.node path[stroke="#1b7f3b"], .rendered svg g.node polygon[stroke="#1b7f3b"]')
        assert accepted.count() == step.accept_length, accepted.count()
        picture_text = " ".join(t or "" for t in page.locator(".rendered svg text").all_text_contents())
        assert "no target rows recorded" in picture_text and "NOTE:" in picture_text
        note = page.locator(".ddtree-missing").first
        assert note.is_visible() and "no target rows recorded" in note.inner_text()
        assert "no decision log recorded" in page.locator(".ddtree-verdict").inner_text()
        assert page.locator(".stepper svg g.node").count() >= step.accept_length + 1 + len(bonus)  # root, path, bonus
        stepper_path = page.locator('.stepper svg g.node path[stroke="#1b7f3b"], .stepper svg g.node polygon[stroke="#1b7f3b"]')
        assert stepper_path.count() == step.accept_length  # the stepper shows the recorded path, not "pending"
        screenshot(page, f"reference_{dump.stem}_{dump.suffix.lstrip('.')}")
    finally:
        page.close()
