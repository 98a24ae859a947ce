"""Layout conversions between the lab's verify buffers and SGLang's (no sglang needed)."""

import pytest
import torch

import ddtree_lab as dl
from ddtree_lab.sglang import buffers as sb
from ddtree_lab.sglang.buffers import TreeMaskMode
from ddtree_lab.replaying import compare_outputs

FIELDS = ("node_token_ids", "retrieve_index", "retrieve_next_token", "retrieve_next_sibling", "tree_mask",
          "positions", "depths", "num_nodes")

# SGLang's published greedy example (RECIPES.md; sgl-kernel test_verify_tree_greedy).
EX_CANDIDATES = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]])
EX_NEXT_TOKEN = torch.tensor([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]])
EX_NEXT_SIBLING = torch.tensor([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]])
EX_TARGET_PREDICT = torch.tensor([3, 3, 3, 4, 5, 18, 11, 11, 11, 11, 12, 18]).view(2, 6)
EX_PREDICTS = [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]
EX_ACCEPT_INDEX = [[0, 3, 4, 5], [6, 10, 11, -1]]
EX_ACCEPT_NUM = [3, 2]


def _random_vi(seed, bs=3, vocab=20, depth=4, k=3, budget=10, prefix=None):
    g = torch.Generator().manual_seed(seed)
    ids, lp = dl.draft_topk_from_logits(torch.randn(bs, depth, vocab, generator=g) * 2, k=k)
    tree = dl.build_tree(ids, lp, torch.randint(0, vocab, (bs,), generator=g), budget)
    prefix = torch.randint(0, 9, (bs,), generator=g) if prefix is None else prefix
    return tree, dl.compile_retrieve(tree, prefix)


def _same(a, b):
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in FIELDS)


@pytest.mark.parametrize("mode", list(TreeMaskMode))
@pytest.mark.parametrize("seed", range(6))
def test_lab_to_sglang_and_back_round_trips_in_every_mask_mode(seed, mode):
    _, vi = _random_vi(seed, budget=5 + seed)
    buffers = sb.to_sglang_buffers(vi, mode)
    assert sb.find_sglang_buffer_problem(buffers) is None
    assert _same(sb.from_sglang_buffers(buffers), vi)


def test_round_trip_keeps_padding_rows_of_small_trees():
    # -inf draft log-probs beyond the first column: one chain, far fewer nodes than the budget
    ids = torch.tensor([[[3, 4], [5, 6]]])
    lp = torch.tensor([[[0.0, -torch.inf], [0.0, -torch.inf]]])
    tree = dl.build_tree(ids, lp, torch.tensor([1]), 6)
    vi = dl.compile_retrieve(tree, 2)
    assert int(vi.num_nodes[0]) < vi.num_rows
    for mode in TreeMaskMode:
        assert _same(sb.from_sglang_buffers(sb.to_sglang_buffers(vi, mode)), vi)


def test_buffer_shapes_and_dtypes_are_sglangs():
    _, vi = _random_vi(1, bs=2, budget=9, prefix=torch.tensor([3, 5]))
    n = vi.num_rows
    full = sb.to_sglang_buffers(vi, TreeMaskMode.FULL_MASK)
    assert full.draft_token.shape == (2 * n,) and full.draft_token.dtype == torch.int64
    assert full.positions.shape == (2 * n,)
    assert full.retrive_index.shape == (2, n)
    assert full.tree_mask.dtype == torch.bool and full.tree_mask.shape == ((3 + 5) * n + 2 * n * n,)
    assert sb.to_sglang_buffers(vi, TreeMaskMode.QLEN_ONLY).tree_mask.shape == (2 * n * n,)
    packed = sb.to_sglang_buffers(vi, TreeMaskMode.QLEN_ONLY_BITPACKING).tree_mask
    assert packed.shape == (2 * n,) and packed.dtype == torch.uint16  # N = 10


@pytest.mark.parametrize("n,dtype", [(1, torch.uint8), (8, torch.uint8), (9, torch.uint16), (16, torch.uint16),
                                     (17, torch.uint32), (32, torch.uint32)])
def test_bitpacked_row_width_is_1_2_4_bytes_bit0_the_root(n, dtype):
    g = torch.Generator().manual_seed(n)
    mask = torch.rand(2, n, n, generator=g) < 0.5
    packed = sb.pack_tree_mask(mask)
    assert packed.dtype == dtype and packed.shape == (2 * n,)
    assert torch.equal(sb.unpack_tree_mask(packed, n), mask)
    one = torch.zeros(1, n, n, dtype=torch.bool)
    one[0, n - 1, 0] = True  # last row attends to the root only
    assert int(sb.pack_tree_mask(one)[n - 1].to(torch.int64)) == 1


def test_bitpacking_refuses_more_than_32_columns_like_sglang():
    with pytest.raises(ValueError, match="at most 32"):
        sb.pack_tree_mask(torch.ones(1, 33, 33, dtype=torch.bool))


def test_published_greedy_example_tree_converts_and_checks():
    vi = sb.verify_input_from_retrieve(EX_CANDIDATES, EX_NEXT_TOKEN, EX_NEXT_SIBLING, seq_lens=7)
    assert vi.depths.tolist() == [[0, 1, 2, 1, 2, 3], [0, 1, 2, 3, 1, 2]]
    assert vi.positions[0].tolist() == [7, 8, 9, 8, 9, 10]
    for mode in TreeMaskMode:
        buffers = sb.to_sglang_buffers(vi, mode)
        assert sb.find_sglang_buffer_problem(buffers) is None
        assert _same(sb.from_sglang_buffers(buffers), vi)
    # request 1: 0 -> {4, 1}, 4 -> 5, 1 -> 2 -> 3; row 3 sees 0, 1, 2, 3
    assert vi.tree_mask[1, 3].tolist() == [True, True, True, True, False, False]


@pytest.mark.parametrize("next_token,next_sibling", [
    ([1, 3, 4, 5, 6, 7, -1, -1], [-1, 2, -1, -1, -1, -1, -1, -1]),   # 0->{1,2}, 1->3->5->7, 2->4->6
    ([1, 2, -1, 6, -1, -1, 7, -1], [-1, -1, 3, 4, 5, -1, -1, -1]),   # 0->1->{2,3,4,5}, 3->6->7
])
def test_core_issue_vectors_round_trip_through_every_mask_mode(next_token, next_sibling):
    nt, ns = torch.tensor([next_token]), torch.tensor([next_sibling])
    vi = sb.verify_input_from_retrieve(torch.arange(10, 18)[None], nt, ns, seq_lens=4)
    parents, _ = dl.decode_retrieve(nt, ns)
    assert torch.equal(dl.encode_retrieve(parents, torch.tensor([8]))[1], nt)
    for mode in TreeMaskMode:
        assert _same(sb.from_sglang_buffers(sb.to_sglang_buffers(vi, mode)), vi)


def test_buffer_checker_names_a_wrong_mask_cell_and_a_wrong_position():
    _, vi = _random_vi(2, bs=2, budget=8, prefix=torch.tensor([3, 4]))
    buffers = sb.to_sglang_buffers(vi, TreeMaskMode.QLEN_ONLY)
    bad_mask = buffers.tree_mask.clone().view(2, vi.num_rows, vi.num_rows)
    bad_mask[1, 3, 2] = ~bad_mask[1, 3, 2]
    broken = sb.SGLangVerifyBuffers(**{**buffers.__dict__, "tree_mask": bad_mask.reshape(-1)})
    assert "request 1, row 3" in sb.find_sglang_buffer_problem(broken)
    bad_pos = buffers.positions.clone()
    bad_pos[vi.num_rows + 2] += 1
    broken = sb.SGLangVerifyBuffers(**{**buffers.__dict__, "positions": bad_pos})
    assert "request 1, row 2: position" in sb.find_sglang_buffer_problem(broken)
    full = sb.to_sglang_buffers(vi, TreeMaskMode.FULL_MASK)
    no_prefix = full.tree_mask.clone()
    no_prefix[0] = False
    broken = sb.SGLangVerifyBuffers(**{**full.__dict__, "tree_mask": no_prefix})
    assert "prefix column" in sb.find_sglang_buffer_problem(broken)


@pytest.mark.parametrize("seed", range(5))
def test_verify_output_to_sglang_and_back_round_trips(seed):
    tree, vi = _random_vi(seed, bs=3, vocab=8, budget=10)
    g = torch.Generator().manual_seed(50 + seed)
    logits = torch.randn(3, vi.num_rows, 8, generator=g)
    for b in range(3):
        for i in range(1, int(tree.num_nodes[b])):
            if torch.rand(1, generator=g) < 0.6:
                logits[b, int(tree.parents[b, i]), int(tree.node_token_ids[b, i])] += 5
    out = dl.verify_greedy(vi, logits)
    predicts, accept_index, accept_num = sb.verify_output_to_sglang(out, vi.num_rows)
    assert predicts.dtype == accept_index.dtype == accept_num.dtype == torch.int32
    back = sb.verify_output_from_sglang(vi, predicts, accept_index, accept_num)
    assert compare_outputs(out, back, decisions=False) == []


def test_published_greedy_outputs_convert_to_the_labs_verify_output():
    vi = sb.verify_input_from_retrieve(EX_CANDIDATES, EX_NEXT_TOKEN, EX_NEXT_SIBLING)
    out = sb.verify_output_from_sglang(vi, torch.tensor(EX_PREDICTS), torch.tensor(EX_ACCEPT_INDEX), torch.tensor(EX_ACCEPT_NUM))
    assert out.accept_index[:, :4].tolist() == [[0, 3, 4, 5], [0, 4, 5, -1]]
    assert out.emitted_tokens[:, :4].tolist() == [[3, 4, 5, 18], [11, 12, 18, -1]]
    assert out.bonus_token.tolist() == [18, 18]
    # and the lab's greedy verifier gives the same on the same target argmax
    logits = torch.nn.functional.one_hot(EX_TARGET_PREDICT, 20).float()
    assert compare_outputs(dl.verify_greedy(vi, logits), out, decisions=False) == []


def test_corrupt_sglang_output_is_named():
    vi = sb.verify_input_from_retrieve(EX_CANDIDATES, EX_NEXT_TOKEN, EX_NEXT_SIBLING)
    predicts = torch.tensor(EX_PREDICTS)
    predicts[3] = 9  # row 3 must hold the next accepted token (4)
    with pytest.raises(ValueError, match="request 0: predicts"):
        sb.verify_output_from_sglang(vi, predicts, torch.tensor(EX_ACCEPT_INDEX), torch.tensor(EX_ACCEPT_NUM))
    with pytest.raises(ValueError, match="outside"):
        sb.verify_output_from_sglang(vi, torch.tensor(EX_PREDICTS), torch.tensor([[0, 3, 4, 5], [0, 10, 11, -1]]),
                                     torch.tensor(EX_ACCEPT_NUM))


@pytest.mark.parametrize("seed", range(4))
def test_eagle_tree_inputs_describe_the_same_tree(seed):
    _, vi = _random_vi(seed, bs=2, budget=9)
    parent_list, selected, topk, depth = sb.eagle_tree_inputs(vi)
    parents, _ = dl.decode_retrieve(vi.retrieve_next_token, vi.retrieve_next_sibling, vi.num_nodes)
    for b in range(2):  # SGLang's builder's parent rule, in Python
        for i in range(1, vi.num_rows):
            group = int(selected[b, i - 1]) // topk
            want = 0 if group == 0 else 1 + selected[b].tolist().index(int(parent_list[b, group]))
            assert want == int(parents[b, i])
    assert depth > int(vi.depths.max())


def test_buffer_checks_report_every_problem_not_only_the_first():
    _, vi = _random_vi(2, bs=3, budget=8, prefix=torch.tensor([3, 4, 5]))
    n = vi.num_rows
    buffers = sb.to_sglang_buffers(vi, TreeMaskMode.QLEN_ONLY)
    mask = buffers.tree_mask.clone().view(3, n, n)
    mask[0, 2, 0] = False  # row 2 of request 0 no longer sees the root
    positions = buffers.positions.clone()
    positions[2 * n + 1] += 1  # request 2, row 1
    nt = buffers.retrive_next_token.clone()
    ns = buffers.retrive_next_sibling.clone()
    first = int(nt[1, 0])
    ns[1, first] = first  # request 1: a node listed as its own next sibling (hangs SGLang's walk)
    broken = sb.SGLangVerifyBuffers(**{**buffers.__dict__, "tree_mask": mask.reshape(-1), "positions": positions,
                                       "retrive_next_sibling": ns})
    problems = sb.find_sglang_buffer_problems(broken)
    assert problems[0] == "request 0, row 2: the mask misses ancestor column(s) [0]"
    assert problems[1].startswith("request 1, node 0: sibling chain") and str(first) in problems[1]
    # the loop cuts off the root's later children: each is named (every problem, not the first)
    assert problems[2:-1] and all(p.startswith("request 1, node ") and p.endswith("not reachable from the root")
                                  for p in problems[2:-1]), problems
    assert problems[-1].startswith("request 2, row 1: position")
    assert sb.find_sglang_buffer_problem(broken) == problems[0]
    assert sb.find_sglang_buffer_problems(buffers) == []


def test_buffer_checks_report_two_distinct_link_problems_of_one_request():
    _, vi = _random_vi(3, bs=2, budget=8, prefix=torch.tensor([3, 4]))
    n = vi.num_rows
    buffers = sb.to_sglang_buffers(vi, TreeMaskMode.QLEN_ONLY)
    nt, ri = buffers.retrive_next_token.clone(), buffers.retrive_index.clone()
    leaf = max(i for i in range(1, n) if int(nt[1, i]) == -1)
    nt[1, leaf] = n + 4  # request 1: a first-child link out of range
    ri[1, 2] = 2  # request 1, node 2: a request-0 row index (SGLang's rows are b * N + i)
    broken = sb.SGLangVerifyBuffers(**{**buffers.__dict__, "retrive_next_token": nt, "retrive_index": ri})
    problems = sb.find_sglang_buffer_problems(broken)
    assert len(problems) == 2, problems
    assert any(p.startswith(f"request 1, node {leaf}: ") and "retrieve_next_token" in p and str(n + 4) in p
               for p in problems), problems
    assert any(p.startswith("request 1, node 2: retrieve_index = 2, expected") for p in problems), problems
