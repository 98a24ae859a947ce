import math

import pytest
import torch

import ddtree_lab as dl
from ddtree_lab import SamplingParams as SP


def _probs(logits, params):
    return dl.target_probs(logits[None, None].float(), params)[0, 0]


def test_greedy_rows_are_one_hot_lowest_id_on_ties():
    p = _probs(torch.tensor([1.0, 5.0, 5.0, 0.0]), SP(temperature=0.0))
    assert p.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_temperature_then_top_k_then_top_p_order():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    p = _probs(logits, SP(temperature=0.5, top_k=3, top_p=0.8))
    # by hand: scale, keep top-3, softmax, then top-p 0.8 over the survivors, renormalise
    scaled = logits[:3] / 0.5
    q = torch.softmax(scaled, 0)  # [0.8438, 0.1142, 0.0420]
    assert q[0] >= 0.8  # the first alone reaches 0.8
    assert p.tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0, 0.0])
    p = _probs(logits, SP(temperature=0.5, top_k=3, top_p=0.9))
    assert p.tolist() == pytest.approx([(q[0] / q[:2].sum()).item(), (q[1] / q[:2].sum()).item(), 0, 0, 0])
    # The order matters: [0.5, 0.3, 0.2] with top_k 2 then top_p 0.6 renormalises to
    # [0.625, 0.375] and keeps one token; top-p first over the full row would keep two.
    p = _probs(torch.tensor([0.5, 0.3, 0.2]).log(), SP(top_k=2, top_p=0.6))
    assert p.tolist() == [1.0, 0.0, 0.0]


def test_top_k_keeps_all_ties_at_the_boundary():
    p = _probs(torch.tensor([3.0, 2.0, 2.0, 1.0]), SP(temperature=1.0, top_k=2))
    assert (p > 0).tolist() == [True, True, True, False]


def test_top_p_keeps_ties_at_the_cut_and_tokens_below_the_mass():
    # probabilities 0.4, 0.2, 0.2, 0.2: with top_p 0.5 the cut lands on a 0.2 -> all 0.2s kept
    logits = torch.tensor([0.4, 0.2, 0.2, 0.2]).log()
    assert (_probs(logits, SP(top_p=0.5)) > 0).all()
    # with top_p 0.4 the first alone reaches it
    assert (_probs(logits, SP(top_p=0.4)) > 0).tolist() == [True, False, False, False]


def test_min_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    p = _probs(logits, SP(min_p=0.5))
    assert (p > 0).tolist() == [True, True, False, False]
    assert p.sum().item() == pytest.approx(1.0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-1.0), "temperature must be finite and >= 0"),
        (dict(top_p=0.0), "top_p must be in"),
        (dict(top_p=1.5), "top_p must be in"),
        (dict(temperature=float("nan")), "temperature is NaN"),
        (dict(top_p=float("nan")), "top_p is NaN"),
        (dict(min_p=2.0), "min_p must be in"),
        (dict(min_p=-0.1), "min_p must be in"),
        (dict(min_p=float("nan")), "min_p must be a number or None"),
        (dict(top_k=2.5), "top_k must be an int"),
        (dict(top_k=True), "top_k must be an int"),
        (dict(seed="7"), "seed must be an int or None"),
        (dict(seed=-1), r"seed must be in \[0, 2\*\*63\)"),
        (dict(temperature="hot"), "temperature must be a number"),
        (dict(order="top_p_first"), "order must be one of"),
    ],
)
def test_invalid_params_are_refused_when_made_naming_the_argument(kwargs, message):
    with pytest.raises(ValueError, match="SamplingParams: " + message):
        SP(**kwargs)
    with pytest.raises(ValueError, match=message):  # also when read back from a dict
        SP.from_dict({**SP().to_dict(), **kwargs})


def test_top_k_beyond_the_vocabulary_names_the_request():
    with pytest.raises(ValueError, match="request 1: top_k = 9 exceeds the vocabulary size 8"):
        dl.target_probs(torch.zeros(2, 1, 8), [SP(), SP(top_k=9)])


def test_params_dicts_round_trip_and_v1_dicts_get_the_default_order():
    p = SP(0.7, top_k=5, top_p=0.9, min_p=0.05, seed=3, order="top_p_then_top_k")
    assert SP.from_dict(p.to_dict()) == p
    v1 = {"temperature": 0.8, "top_k": 0, "top_p": 1.0, "min_p": None, "seed": 8}  # no "order" key
    assert SP.from_dict(v1).order == "top_k_then_top_p" == dl.sampling.ORDERS[0]
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        SP.from_dict({**v1, "topk": 3})


def test_the_other_order_is_available_on_request_and_plain_sampling_uses_the_same_rows():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    default = _probs(logits, SP(top_k=2, top_p=0.5))
    other = _probs(logits, SP(top_k=2, top_p=0.5, order="top_p_then_top_k"))
    assert (default > 0).tolist() == [True, False, False, False]
    assert (other > 0).tolist() == [True, True, False, False]
    assert other.tolist() == pytest.approx([4 / 7, 3 / 7, 0, 0])
    # the lazy backend's row function is the reference's in both orders
    from ddtree_lab.verify import lazy_row_probs
    for order in dl.sampling.ORDERS:
        p = SP(0.9, top_k=3, top_p=0.6, order=order)
        row = torch.randn(50, generator=torch.Generator().manual_seed(1))
        assert torch.equal(lazy_row_probs(row, p), _probs(row, p))


def test_bad_rows_name_request_and_node():
    logits = torch.zeros(2, 3, 4)
    logits[1, 2, 0] = float("nan")
    with pytest.raises(ValueError, match="request 1, node 2: row has NaN"):
        dl.target_probs(logits, SP())
    logits = torch.zeros(2, 3, 4)
    logits[0, 1] = -math.inf
    with pytest.raises(ValueError, match="request 0, node 1: row has every entry -inf"):
        dl.target_probs(logits, SP())
    # padding rows are not checked when num_nodes says they are padding
    out = dl.target_probs(logits, SP(), num_nodes=torch.tensor([1, 3]))
    assert out[0, 1:].abs().sum() == 0


def test_rows_sum_to_one_in_a_mixed_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5, 50, generator=g, dtype=torch.float32).bfloat16()
    params = [SP(0.0), SP(0.7, top_k=10), SP(1.3, top_p=0.6), SP(1.0, top_k=5, top_p=0.9, min_p=0.1)]
    p = dl.target_probs(logits, params)
    assert p.dtype == torch.float32
    torch.testing.assert_close(p.sum(-1), torch.ones(4, 5))
    # top-k keeps exactly the tokens at or above the k-th value (bf16 ties can add more)
    scaled = logits[1].float() / 0.7
    kth = scaled.topk(10, -1).values[:, -1:]
    assert torch.equal(p[1] > 0, scaled >= kth)


def test_tiny_temperature_and_huge_seed_are_rejected():
    with pytest.raises(ValueError, match="temperature 1e-40 is too small"):
        SP(temperature=1e-40)
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*63\)"):
        SP(seed=2**70)


def test_banned_tokens_get_no_mass_on_every_backend_greedy_included():
    from ddtree_lab.verify import verify_tree

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 3, 40, generator=g)
    logits[0, :, 7] = 9.0  # the argmax everywhere, then banned
    for p in (SP(temperature=0.0, banned_token_ids=(7,)),
              SP(temperature=0.9, top_k=5, top_p=0.8, banned_token_ids=(7, 3))):
        rows = dl.target_probs(logits, p)
        assert float(rows[..., list(p.banned_token_ids)].abs().max()) == 0.0
        assert torch.allclose(rows.sum(-1), torch.ones(1, 3))
        if p.is_greedy:
            assert rows[0].argmax(-1).tolist() == logits[0].clone().index_fill_(-1, torch.tensor([7]), -1e9).argmax(-1).tolist()
        tree = dl.DDTreeBuildResult(node_token_ids=torch.tensor([[1, 7, 2]]), parents=torch.tensor([[-1, 0, 0]]),
                                    depths=torch.tensor([[0, 1, 1]]), ranks=torch.tensor([[-1, 0, 1]]),
                                    node_logws=torch.tensor([[0.0, -0.1, -0.5]]), num_nodes=torch.tensor([3]))
        vi = dl.compile_retrieve(tree, 5)
        coins, final = torch.rand(1, 3, generator=g), torch.rand(1, generator=g)
        outs = [verify_tree(vi, logits, p, coins, final, backend=b) for b in ("reference", "torch-lazy", "triton")]
        for o in outs:
            assert 1 not in o.accept_index[0].tolist()  # node 1 is the banned token 7: never accepted
            assert int(o.bonus_token[0]) not in p.banned_token_ids
            assert o.accept_index.equal(outs[0].accept_index) and o.bonus_token.equal(outs[0].bonus_token)


def test_banned_tokens_are_validated_and_round_trip():
    with pytest.raises(ValueError, match="banned_token_ids must be a tuple"):
        SP(banned_token_ids=[3])
    with pytest.raises(ValueError, match="banned_token_ids must be a tuple"):
        SP(banned_token_ids=(-1,))
    assert "outside the vocabulary" in SP(banned_token_ids=(50,)).problem(vocab_size=40)
    p = SP(temperature=0.7, banned_token_ids=(2, 5))
    assert SP.from_dict(p.to_dict()) == p and p.to_dict()["banned_token_ids"] == [2, 5]
    assert "banned_token_ids" not in SP().to_dict()  # files without bans stay as they were
    assert p.label() == "T=0.7 banned=[2, 5]"
    with pytest.raises(ValueError, match="must be a list"):
        SP.from_dict({"banned_token_ids": 3})
