
import pytest
import torch

import ddtree_lab as dl


def _tree_from_parents(parents):
    """A DDTreeBuildResult for a hand-made tree in tree order (log-weights decrease)."""
    n = len(parents)
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
    return dl.DDTreeBuildResult(
        node_token_ids=torch.arange(100, 100 + n)[None],
        parents=torch.tensor([parents]),
        depths=torch.tensor([depths]),
        ranks=torch.zeros(1, n, dtype=torch.int64),
        node_logws=-torch.arange(n, dtype=torch.float32)[None],
        num_nodes=torch.tensor([n]),
    )


@pytest.mark.parametrize(
    "parents, next_token, next_sibling",
    [
        # SGLang's published example: 0 -> {1, 2}, 1 -> 3 -> 5 -> 7, 2 -> 4 -> 6
        ([-1, 0, 0, 1, 2, 3, 4, 5], [1, 3, 4, 5, 6, 7, -1, -1], [-1, 2, -1, -1, -1, -1, -1, -1]),
        # 0 -> 1 -> {2, 3, 4, 5}, 3 -> 6 -> 7
        ([-1, 0, 1, 1, 1, 1, 3, 6], [1, 2, -1, 6, -1, -1, 7, -1], [-1, -1, 3, 4, 5, -1, -1, -1]),
    ],
)
def test_sglang_published_vectors(parents, next_token, next_sibling):
    vi = dl.compile_retrieve(_tree_from_parents(parents), prefix_len=10)
    assert vi.retrieve_next_token[0].tolist() == next_token
    assert vi.retrieve_next_sibling[0].tolist() == next_sibling
    assert vi.retrieve_index[0].tolist() == list(range(8))
    dl.check_retrieve(vi)
    back, depths = dl.decode_retrieve(vi.retrieve_next_token, vi.retrieve_next_sibling)
    assert back[0].tolist() == parents
    assert vi.positions[0].tolist() == (10 + depths[0]).tolist()


@pytest.mark.parametrize("seed", range(8))
def test_round_trip_mask_and_positions_on_built_trees(seed):
    g = torch.Generator().manual_seed(seed)
    ids, lp = dl.draft_topk_from_logits(torch.randn(4, 6, 40, generator=g) * 3, k=5)
    tree = dl.build_tree(ids, lp, torch.arange(4), [0, 5, 17, 30])
    vi = dl.compile_retrieve(tree, torch.tensor([3, 0, 9, 100]))
    dl.check_retrieve(vi, tree.node_logws)
    parents, depths = dl.decode_retrieve(vi.retrieve_next_token, vi.retrieve_next_sibling, vi.num_nodes)
    assert torch.equal(parents, tree.parents) and torch.equal(depths, tree.depths)
    n = vi.num_rows
    for b in range(4):
        count = int(tree.num_nodes[b])
        assert vi.retrieve_index[b, :count].tolist() == [b * n + i for i in range(count)]
        for i in range(n):
            if i < count:
                anc = {i}
                j = i
                while j > 0:
                    j = int(tree.parents[b, j])
                    anc.add(j)
                assert vi.tree_mask[b, i].nonzero().flatten().tolist() == sorted(anc)
                assert int(vi.positions[b, i]) == [3, 0, 9, 100][b] + int(tree.depths[b, i])
            else:  # padding: only itself, and nobody attends to it
                assert vi.tree_mask[b, i].nonzero().flatten().tolist() == [i]
                assert not bool(vi.tree_mask[b, :count, i].any())
                assert int(vi.retrieve_index[b, i]) == -1


def _buffers():
    vi = dl.compile_retrieve(_tree_from_parents([-1, 0, 0, 1, 2, 3, 4, 5]), 0)
    return vi.retrieve_next_token.clone(), vi.retrieve_next_sibling.clone()


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda nt, ns: nt.__setitem__((0, 5), 1), "request 0, node 1: reached twice"),  # cycle 1->3->5->1
        (lambda nt, ns: ns.__setitem__((0, 3), 4), "request 0, node 4: reached twice"),  # 4 under 1 and 2
        (lambda nt, ns: nt.__setitem__((0, 2), 9), "request 0, node 2: retrieve_next_token = 9 is out of range"),
        (lambda nt, ns: ns.__setitem__((0, 6), -2), "request 0, node 6: retrieve_next_sibling = -2 is out of range"),
        (lambda nt, ns: nt.__setitem__((0, 4), -1), "request 0, node 6: not reachable"),
        (lambda nt, ns: ns.__setitem__((0, 0), 1), "request 0, node 0: the root has a next sibling"),
    ],
)
def test_validator_names_the_first_broken_invariant(edit, message):
    nt, ns = _buffers()
    edit(nt, ns)
    problem = dl.find_retrieve_problem(nt, ns)
    assert problem is not None and message in str(problem)
    with pytest.raises(dl.RetrieveError, match=message):
        dl.decode_retrieve(nt, ns)


def test_validator_checks_sibling_order_depths_and_index():
    vi = dl.compile_retrieve(_tree_from_parents([-1, 0, 0, 1, 2, 3, 4, 5]), 0)
    logws = -torch.arange(8, dtype=torch.float32)[None].clone()
    logws[0, 2] = 5.0  # node 2 follows sibling 1 with a larger log-weight
    with pytest.raises(dl.RetrieveError, match="request 0, node 2: sibling chain out of log-weight order"):
        dl.check_retrieve(vi, logws)
    bad_depths = vi.depths.clone()
    bad_depths[0, 7] = 9
    problem = dl.find_retrieve_problem(vi.retrieve_next_token, vi.retrieve_next_sibling, depths=bad_depths)
    assert "node 7: depth 9 is not parent depth 3 + 1" in str(problem)
    bad_index = vi.retrieve_index.clone()
    bad_index[0, 3] = 0
    problem = dl.find_retrieve_problem(vi.retrieve_next_token, vi.retrieve_next_sibling, retrieve_index=bad_index)
    assert "node 3: retrieve_index = 0, expected 3" in str(problem)


def test_encoder_rejects_parents_after_children():
    with pytest.raises(ValueError, match="request 0, node 1: parent 2 must be in"):
        dl.encode_retrieve(torch.tensor([[-1, 2, 0]]), torch.tensor([3]))


def test_doctor_reports_every_broken_invariant_with_request_node_and_field():
    good = dl.compile_retrieve(_tree_from_parents([-1, 0, 0, 1, 2, 3, 4, 5]), 3)
    ri = torch.arange(3)[:, None] * 8 + torch.arange(8)[None]
    vi = dl.DDTreeVerifyInput(**{**{f: torch.cat([getattr(good, f)] * 3) for f in good.__dict__}, "retrieve_index": ri})
    ri = ri.clone()
    nt, ns = vi.retrieve_next_token.clone(), vi.retrieve_next_sibling.clone()
    nt[0, 5] = 1  # request 0: a cycle 1 -> 3 -> 5 -> 1 through retrieve_next_token
    ns[1, 3] = 3  # request 1: node 3 is its own next sibling
    ns[1, 6] = 9  # ... and a link out of range
    depths, positions, mask = vi.depths.clone(), vi.positions.clone(), vi.tree_mask.clone()
    depths[2, 7] = 5  # request 2: a wrong depth,
    positions[2, 4] += 1  # a position off by one,
    mask[2, 6, 2] = False  # a mask row missing an ancestor,
    mask[2, 3, 2] = True  # and one seeing a non-ancestor
    ri[2, 1] = 0
    bad = dl.DDTreeVerifyInput(**{**vi.__dict__, "retrieve_next_token": nt, "retrieve_next_sibling": ns,
                                  "depths": depths, "positions": positions, "tree_mask": mask, "retrieve_index": ri})
    logws = -torch.arange(8, dtype=torch.float32)[None].repeat(3, 1)
    logws[2, 2] = 1.0  # request 2: siblings out of log-weight order
    problems = dl.find_retrieve_problems(bad, node_logws=logws)
    got = {(p.request, p.node, p.field, p.kind) for p in problems}
    assert {(0, 1, "retrieve_next_token", "cycle"), (1, 1, "retrieve_next_sibling", "cycle"),
            (1, 6, "retrieve_next_sibling", "range"), (2, 7, "depths", "depth"), (2, 4, "positions", "position"),
            (2, 6, "tree_mask", "mask_missing_ancestor"), (2, 3, "tree_mask", "mask_non_ancestor"),
            (2, 2, "node_logws", "sibling_order"), (2, 1, "retrieve_index", "index")} <= got
    cycle = next(p for p in problems if p.request == 0 and p.kind == "cycle")
    assert cycle.nodes == (1, 3, 5) and "1 -> 3 -> 5 -> 1" in str(cycle)
    own = next(p for p in problems if p.request == 1 and p.kind == "cycle")
    assert own.nodes == (3,) and "a cycle in retrieve_next_sibling: 3 -> 3" in own.message
    assert all(str(p).startswith(f"request {p.request}, node {p.node}: ") for p in problems)
    assert [p.to_dict()["kind"] for p in problems] == [p.kind for p in problems]
    # the first problem, and check_verify_buffers raising it
    assert str(dl.find_retrieve_problems(bad, limit=1)[0]) == str(problems[0])
    with pytest.raises(dl.RetrieveError, match="request 0, node 1: reached twice") as err:
        dl.check_verify_buffers(bad)
    assert err.value.problem.kind == "cycle"
    assert dl.find_retrieve_problems(vi) == [] and dl.find_retrieve_problems(vi, node_logws=-torch.arange(8.0).repeat(3, 1)) == []


def test_a_node_both_child_and_sibling_and_repeated_sibling_tokens_are_named():
    vi = dl.compile_retrieve(_tree_from_parents([-1, 0, 0, 1, 1]), 0)
    nt = vi.retrieve_next_token.clone()
    ns = vi.retrieve_next_sibling.clone()
    ns[0, 1] = 3  # node 3: node 1's child and now also its next sibling (node 2 cut off)
    problems = dl.find_retrieve_problems(nt, ns)
    assert any(p.node == 3 and p.kind == "reached_twice" for p in problems)
    assert any(p.node == 2 and p.kind == "unreachable" for p in problems)
    tokens = vi.node_token_ids.clone()
    tokens[0, 4] = tokens[0, 3]
    problems = dl.find_retrieve_problems(dl.DDTreeVerifyInput(**{**vi.__dict__, "node_token_ids": tokens}))
    assert [(p.node, p.kind) for p in problems] == [(4, "duplicate_token")]
