"""Issue 26.2: tokens are shown so that different ids never look alike.

Byte-level tokens (pieces of a Japanese character or an emoji) are recorded with their bytes
(``<0xE3>``, :mod:`ddtree_lab.texts`), and every view labels a token with
:func:`ddtree_lab.views.token_label`: the id beside any ambiguous text and any text two ids
of one view share. The fast tests use texts written by hand (old recordings stored such a
token's text as the decoder's ``'�'``); the slow one uses SmolLM2's tokenizer on a Japanese
prompt.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import ddtree_lab as dl
from ddtree_lab import views
from ddtree_lab.texts import bytes_text, join_texts, text_bytes, token_pieces

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "fixtures" / "traces" / "smollm2_t08_b32.ddtrace.safetensors"
REPLACEMENT = "\ufffd"


def test_token_label_shows_bytes_and_whitespace_and_the_id_where_the_text_is_ambiguous():
    assert views.token_label(" the", 278) == "'␣the'"  # plain text: no id
    assert views.token_label("<0xE3>", 7365) == "'<0xE3>' id 7365"  # a raw byte: the id beside it
    assert views.token_label(REPLACEMENT, 237) == "'�' id 237"  # an old recording's '�'
    assert views.token_label("a<0xE3><0x81>", 5) == "'a<0xE3><0x81>' id 5"
    assert views.token_label("", 19) == "'' id 19"
    assert views.token_label("␣", 9) == "'␣' id 9"  # a literal mark is not a space
    assert views.token_label(" ", 8) == "'␣'"
    assert views.token_label("\x1b", 4) == "'\\x1b' id 4" and views.token_label("\\x1b", 3) == "'\\x1b' id 3"
    assert views.token_label(" cat", 1, shared=True) == "'␣cat' id 1"
    assert views.token_label("<0xE3>") == "'<0xE3>'"  # no id given: nothing to add
    texts = {1: REPLACEMENT, 2: REPLACEMENT, 3: " a", 4: " a", 5: " b"}
    assert views.shared_text_ids(texts, texts.__getitem__) == {1, 2, 3, 4}


def test_recorded_texts_keep_the_bytes_of_partial_characters():
    data = "こんにちは 🙂".encode()
    assert bytes_text(data[:1]) == "<0xE3>" and bytes_text(data[1:3]) == "<0x81><0x93>"
    assert bytes_text(b"a\xe3\x81") == "a<0xE3><0x81>" and text_bytes("a<0xE3><0x81>") == b"a\xe3\x81"
    pieces = [bytes_text(data[i:i + 1]) for i in range(len(data))]  # one byte per token
    assert all("<0x" in p or p == " " for p in pieces)
    assert join_texts(pieces) == "こんにちは 🙂"
    split = token_pieces(pieces)
    assert "".join(split) == "こんにちは 🙂" and split[:3] == ["", "", "こ"]
    assert token_pieces(["x", "<0xE3>"]) == ["x", "<0xE3>"]  # bytes left incomplete at the end stay escapes
    with pytest.raises(TypeError, match="bytes"):
        bytes_text("text")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def clash():
    """The fixture trace with two different tokens of one step (the accepted root child and a
    rejected sibling) both recorded as '�', as a recording made before the bytes were kept."""
    run = dl.load_trace(TRACE)
    step = next(s for s in run.steps if s.accept_length >= 1 and any(
        d.verdict == "reject" and d.parent == 0 for d in s.decisions))
    tokens = step.node_token_ids
    assert tokens is not None
    accepted = int(tokens[step.accepted_path[1]])
    rejected = next(d.token for d in step.decisions if d.verdict == "reject" and d.parent == 0 and d.token != accepted)
    texts = dict(run.token_texts)
    texts[accepted] = texts[rejected] = REPLACEMENT
    return dataclasses.replace(run, token_texts=texts), step, accepted, rejected


def _tell_apart(text: str, a: int, b: int) -> None:
    """Both tokens shown, each with its own id (after the label, or before it as in a tooltip's
    ``token N '�'``), and no bare '�' label."""
    assert f"'�' id {a}" in text and f"'�' id {b}" in text, text[:400]
    for t in (a, b):
        text = text.replace(f"'�' id {t}", "").replace(f"token {t} '�'", "")
    assert "'�'" not in text


def test_two_ids_with_the_same_text_render_differently_in_every_view(clash, tmp_path):
    import html as html_mod

    run, step, a, b = clash
    view = views.step_view(step, run).at(1)  # the first decision judged
    assert view.label(a) != view.label(b)
    _tell_apart(views.to_text(view), a, b)
    _tell_apart(views.decisions_text(view), a, b)
    _tell_apart(views.to_dot(view), a, b)
    _tell_apart(html_mod.unescape(views.decisions_table_html(view)), a, b)
    _tell_apart(html_mod.unescape(views.children_html(views.step_view(step, run))), a, b)
    svg = html_mod.unescape(views.step_svg(step, run))
    _tell_apart(svg, a, b)

    stepper = views.VerifyStepper(run, request=step.request, step=run.for_request(step.request).index(step))
    stepper.go(stepper.num_events)
    _tell_apart(html_mod.unescape(stepper.details_html() + stepper.picture_svg()), a, b)

    from ddtree_lab.analysis import TunerData
    from ddtree_lab.views import tuner as tv

    data = TunerData.from_run(run)
    k = next(j for j, s in enumerate(data.steps) if s.step == step.step and s.request == step.request)
    dot = tv.reach_tree_dot(data, data.analyse(step.params, 32), k, run, max_children=None)
    _tell_apart(dot, a, b)

    from ddtree_lab.io import bundle as bd

    out = bd.save_bundle(bd.make_bundle(run, step.step, step.request), tmp_path / "bundle")
    readme = (out / "README.md").read_text()
    assert f"| {a} `'�'` |" in readme and f"| {b} `'�'` |" in readme  # the id first in every row


def test_byte_tokens_render_as_escapes_and_the_committed_text_joins_them(clash):
    run, step, a, b = clash
    texts = dict(run.token_texts)
    texts[a], texts[b] = "<0xE3><0x81>", "<0xE3>"
    run = dataclasses.replace(run, token_texts=texts)
    view = views.step_view(step, run)
    for text in (views.to_text(view), views.to_dot(view), views.decisions_text(view)):
        assert f"'<0xE3><0x81>' id {a}" in text and f"'<0xE3>' id {b}" in text and "�" not in text
    # the committed text: a character split over tokens shows whole, each span names its token id
    generated = run.metadata["requests"][0]["generated_token_ids"][:3]
    assert len(set(generated)) == 3
    texts.update({generated[0]: "<0xE3><0x81>", generated[1]: "<0xAB>", generated[2]: "!"})
    body = views.committed_html(dataclasses.replace(run, token_texts=texts), 0).split("<br>", 1)[1]
    assert body.startswith(f'<span title="prefill, token {generated[0]}" style="background:#eeeeee"></span>'
                           f'<span title="step 0: ')
    assert f', token {generated[1]}" ' in body and ">に</span>" in body and ">!</span>" in body


def test_a_reference_round_tree_labels_tokens_with_their_id_and_escapes():
    from ddtree_lab.io.ddtree_reference import read_reference_traces
    from ddtree_lab.views import run_summary as rs

    traces = read_reference_traces(ROOT / "fixtures" / "ddtree_reference" / "generate_result.jsonl")
    r = rs._one_round(traces, 3, 0)
    t0, t1 = r["tokens"][1], r["tokens"][2]
    text = rs.round_tree_text(traces, step=3, request=0, texts={t0: REPLACEMENT, t1: "<0xE3>"})
    assert f"{t0} '�'" in text and f"{t1} '<0xE3>'" in text


def test_a_japanese_prompt_records_byte_tokens_as_escapes_not_replacement_characters(target, drafter):
    prompt = "日本語で挨拶してください。こんにちは 🙂"
    ids = target.tokenizer(prompt)["input_ids"]
    texts = {t: target.token_text(t) for t in ids}
    pieces = [t for t in ids if REPLACEMENT in target.tokenizer.decode([t])]
    assert pieces, "SmolLM2's tokenizer should cut this prompt into byte pieces"
    assert all(REPLACEMENT not in texts[t] and "<0x" in texts[t] for t in pieces)
    assert join_texts(texts[t] for t in ids) == target.tokenizer.decode(ids)
    assert len({texts[t] for t in pieces}) == len(set(pieces))  # different byte tokens never read alike

    session = dl.LiveSession(target, drafter, budget=8, sampling=dl.SamplingParams(temperature=0.0))
    run = session.run(prompt, max_new_tokens=6, chat=False)
    assert not [t for t, x in run.token_texts.items() if REPLACEMENT in x], "a recorded text lost its bytes"
    shown = {t for t in run.token_texts if "<0x" in run.token_texts[t]}
    assert shown & set(ids)  # the prompt's last tokens are among the recorded texts
    for step in run.steps:
        view = views.step_view(step, run)
        for text in (views.to_text(view), views.to_dot(view), views.decisions_text(view)):
            assert "�" not in text
        for t in shown & set(view.token_labels):
            assert view.label(t).endswith(f" id {t}") and "<0x" in view.label(t)
