"""Test support: hand-made Steps whose right answer a reader can check on paper (golden views, stepper).

:func:`make_step` runs the library's own pipeline (``build_tree`` -> ``compile_retrieve`` ->
``target_probs`` -> ``verify_sampled`` -> ``row_records``) on a drafter top-k and target rows
the caller gives, and returns the :class:`ddtree_lab.step.Step` a live session would
have recorded (it replays bit for bit). :func:`golden_cases` are the small trees the view
golden files are made of; :func:`random_step` is a big random one.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ddtree_lab.sampling import SamplingParams, target_probs
from ddtree_lab.record import row_records
from ddtree_lab.step import Run, Step
from ddtree_lab.verify import draw_coins, make_generators, verify_sampled

__all__ = ["make_step", "golden_cases", "random_step"]


def make_step(draft_token_ids: torch.Tensor, draft_logprobs: torch.Tensor, anchor: int, budget: int,
              row: Callable[[tuple[int, ...]], torch.Tensor], params: SamplingParams, *,
              rows_are_probs: bool = False, coins: Sequence[float] | None = None, final_coin: float | None = None,
              step: int = 0, request: int = 0, prefix_len: int = 4, top_m: int = 8) -> Step:
    """One recorded step of one request from hand-made inputs.

    Args:
        draft_token_ids, draft_logprobs: ``[L-1, K]`` int64 / float32, the drafter's top-k per
            depth (rows sorted by descending log-prob).
        anchor: the root token; budget: B.
        row: token path from the root (anchor first) -> that node's target row ``[V]``
            float32: raw logits, or probabilities with ``rows_are_probs``.
        params: the request's sampling parameters (temperature 0: greedy, one-hot rows).
        coins: per node in tree order (length at least the tree's node count), else drawn
            from ``params.seed``; final_coin likewise.
        top_m: tokens kept per display row.

    Raises:
        ValueError: from the pipeline stages (bad shapes, coins outside [0, 1), ...).
    """
    from ddtree_lab.buffers import compile_retrieve
    from ddtree_lab.build import build_tree

    tree = build_tree(draft_token_ids[None], draft_logprobs[None], torch.tensor([anchor]), budget)
    vi = compile_retrieve(tree, torch.tensor([prefix_len]))
    n = int(tree.num_nodes[0])
    parents, tokens = tree.parents[0, :n], tree.node_token_ids[0, :n]
    paths: list[tuple[int, ...]] = []
    for i in range(n):
        paths.append((int(tokens[i]),) if i == 0 else paths[int(parents[i])] + (int(tokens[i]),))
    first = row(paths[0]).float()
    raw = torch.zeros(1, vi.num_rows, first.shape[0])
    for i in range(n):
        raw[0, i] = row(paths[i]).float()
    if rows_are_probs:
        probs, display = raw, raw[0, :n]
    else:
        probs = target_probs(raw, [params], num_nodes=vi.num_nodes)
        display = torch.softmax(raw[0, :n], -1) if params.is_greedy else probs[0, :n]
    if coins is None or final_coin is None:
        drawn, final = draw_coins(make_generators([params]), vi.num_rows)
    if coins is not None:
        drawn = torch.zeros(1, vi.num_rows)
        drawn[0, :n] = torch.tensor(list(coins)[:n], dtype=torch.float32)
    if final_coin is not None:
        final = torch.tensor([final_coin], dtype=torch.float32)
    out = verify_sampled(vi, probs, drawn, final)
    bonus = out.bonus[0]
    records = row_records(parents, tokens, probs[0, :n], display, bonus, top_m)
    return Step.from_fields(
        step=step, request=request, request_id=str(request), prefix_len=prefix_len,
        draft_token_ids=draft_token_ids.clone(), draft_logprobs=draft_logprobs.clone(), node_token_ids=tokens.clone(),
        parents=parents.clone(), depths=tree.depths[0, :n].clone(), ranks=tree.ranks[0, :n].clone(),
        node_logws=tree.node_logws[0, :n].clone(), retrieve_index=vi.retrieve_index[0, :n].clone(),
        retrieve_next_token=vi.retrieve_next_token[0, :n].clone(),
        retrieve_next_sibling=vi.retrieve_next_sibling[0, :n].clone(), positions=vi.positions[0, :n].clone(),
        params=params, coins=drawn[0, :n].clone(), final_coin=float(final[0]), **records,
        final_mass=float(bonus.residual_mass), output=out, timings={}, backend=out.backend)


def _topk(table: list[list[tuple[int, float]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[(token, prob), ...]`` per depth -> draft top-k tensors (log-probs)."""
    ids = torch.tensor([[t for t, _ in r] for r in table], dtype=torch.int64)
    lps = torch.tensor([[p for _, p in r] for r in table], dtype=torch.float64).log().float()
    return ids, lps


def _probs(vocab: int, mass: dict[int, float]) -> torch.Tensor:
    row = torch.zeros(vocab)
    for t, p in mass.items():
        row[t] = p
    return row


# Token texts of the golden cases: 0..9 plain words, 10.. ones that need escaping.
GOLDEN_TEXTS = {0: "<s>", 1: " the", 2: " a", 3: " cat", 4: " dog", 5: " sat", 6: " ran", 7: ".", 8: ",", 9: " on",
                10: 'say "hi"', 11: "back\\slash", 12: "line\nbreak", 13: "<b>&amp;</b>", 14: "{x}", 15: " \t ",
                16: "\\N\\G", 17: "}|{", 18: "\r", 19: ""}
VOCAB = 20


def golden_cases() -> dict[str, tuple[Step, Run]]:
    """The hand-made steps of the view golden files, by name: ``greedy``, ``sampled_residual``
    (a sampled step whose bonus comes from a residual), ``leaf_bonus``, ``exhausted`` (the
    residual is empty: no bonus), ``collapsed`` (a wider tree for the collapse options) and
    ``escaping`` (tokens with quotes, backslashes, newlines, ``<``, ``>``, ``&``, braces and
    whitespace). Each comes with a :class:`Run` holding the token texts."""
    texts = Run(metadata={"requests": []}, steps=[], token_texts=dict(GOLDEN_TEXTS))
    # depth 1: ' the' .5 ' a' .3 ' cat' .2 ; depth 2: ' cat' .6 ' dog' .35 ' ran' .05 ; depth 3: ' sat' .7 ...
    ids, lps = _topk([[(1, .5), (2, .3), (3, .2)], [(3, .6), (4, .35), (6, .05)], [(5, .7), (7, .2), (6, .1)]])
    cases = {}

    def logits(path):  # greedy target: prefers ' a' then ' dog' then ' ran'
        want = {1: 2, 2: 4, 3: 6}.get(len(path), 7)
        row = torch.full((VOCAB,), -4.0)
        row[want] = 2.0
        row[(want + 1) % VOCAB] = 1.0
        return row

    cases["greedy"] = make_step(ids, lps, 0, 6, logits, SamplingParams(temperature=0.0))

    def sampled(path):
        return _probs(VOCAB, {1: 0.10, 2: 0.15, 3: 0.05, 8: 0.40, 9: 0.30}) if len(path) == 1 else \
            _probs(VOCAB, {3: 0.5, 4: 0.2, 7: 0.3})
    # root coin 0.9 > S = 0.30: every child rejected; the bonus comes from the residual
    cases["sampled_residual"] = make_step(ids, lps, 0, 6, sampled, SamplingParams(temperature=1.0),
                                          rows_are_probs=True, coins=[0.9] * 7, final_coin=0.5)
    # accept ' the' (u=.05 < .10), then ' cat' (u=.2 < .5), a leaf at depth 2 (budget 2)
    cases["leaf_bonus"] = make_step(ids, lps, 0, 2, sampled, SamplingParams(temperature=1.0), rows_are_probs=True,
                                    coins=[0.05, 0.2, 0.2], final_coin=0.25)

    def exhausted(path):  # the root row holds no positive mass (as a truncated row can): nothing to draw
        return torch.zeros(VOCAB) if len(path) == 1 else _probs(VOCAB, {5: 1.0})
    ids2, lps2 = _topk([[(1, .6), (2, .4)], [(5, .5), (6, .5)]])  # both root children enter the tree
    cases["exhausted"] = make_step(ids2, lps2, 0, 2, exhausted, SamplingParams(temperature=1.0),
                                   rows_are_probs=True, coins=[0.99999994, 0.0, 0.0], final_coin=0.5)
    wide_ids, wide_lps = _topk([[(t, p) for t, p in zip(range(1, 9), [.3, .2, .15, .1, .1, .07, .05, .03])],
                                [(t, p) for t, p in zip(range(1, 9), [.4, .2, .15, .1, .07, .05, .02, .01])],
                                [(t, p) for t, p in zip([5, 7, 1, 2, 3, 4, 6, 8], [.6, .2, .1, .04, .03, .01, .01, .01])]])

    def wide(path):
        return _probs(VOCAB, {2: 0.05, 1: 0.6, 3: 0.1, 4: 0.05, 5: 0.05, 6: 0.04, 7: 0.04, 8: 0.04, 9: 0.03})
    cases["collapsed"] = make_step(wide_ids, wide_lps, 0, 24, wide, SamplingParams(temperature=0.7, top_k=8),
                                   rows_are_probs=True, coins=[0.3] * 25, final_coin=0.1)
    esc_ids, esc_lps = _topk([[(10, .3), (11, .2), (12, .15), (13, .1), (14, .1), (15, .08), (16, .04), (17, .03)],
                              [(18, .2), (19, .1), (10, .03), (11, .02), (12, .02), (13, .01), (14, .01), (15, .01)]])

    def esc(path):
        return _probs(VOCAB, {10: .01, 11: .02, 12: .02, 13: .05, 14: .1, 15: .2, 16: .1, 17: .5})
    cases["escaping"] = make_step(esc_ids, esc_lps, 13, 11, esc, SamplingParams(temperature=1.0), rows_are_probs=True,
                                  coins=[0.45] * 12, final_coin=0.7)
    return {k: (v, texts) for k, v in cases.items()}


def random_step(budget: int = 256, vocab: int = 512, depth: int = 15, seed: int = 0, temperature: float = 1.0,
                top_k: int | None = None) -> tuple[Step, Run]:
    """A random step with ``budget`` draft nodes (drafter and target rows from seeded
    Gaussian logits) and token texts ``tok<id>``: the render benchmark's 256-node tree."""
    g = torch.Generator().manual_seed(seed)
    draft = torch.randn(1, depth, vocab, generator=g) * 3.0
    from ddtree_lab.draft import draft_topk_from_logits

    ids, lps = draft_topk_from_logits(draft, k=top_k or min(budget, vocab))
    table = torch.randn(4096, vocab, generator=g) * 3.0

    def row(path):
        return table[hash(path) % 4096]

    step = make_step(ids[0], lps[0], 0, budget, row, SamplingParams(temperature=temperature, seed=seed), top_m=16)
    texts = Run(metadata={"requests": []}, steps=[], token_texts={t: f"tok{t}" for t in range(vocab)})
    return step, texts
