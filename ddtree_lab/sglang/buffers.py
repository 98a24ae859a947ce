"""SGLang's verify layout: conversions to and from the lab's buffers, and the buffer checks.

SGLang (sgl-project/sglang, ``srt/speculative/eagle_utils.py``) hands its tree verifiers
flat buffers. This module converts between them and the lab's :class:`DDTreeVerifyInput` /
:class:`VerifyOutput` and checks them. It never imports sglang.

**SGLang's verify buffers** (``bs`` requests, ``N`` = ``draft_token_num`` rows each):

* ``draft_token [bs*N]`` int64, row ``b*N`` is request ``b``'s root (the previous bonus);
  ``candidates`` is the same tensor viewed ``[bs, N]``;
* ``retrive_index`` / ``retrive_next_token`` / ``retrive_next_sibling`` ``[bs, N]`` int64
  (SGLang's spelling; the lab says ``retrieve_*``), same meaning as the lab's buffers;
* ``positions [bs*N]`` int64, ``seq_len + depth``;
* ``tree_mask`` in one of three modes (SGLang ``TreeMaskMode``):

  - ``FULL_MASK`` (0): bool, flat; request ``b`` owns a block of ``N`` rows of
    ``seq_lens[b] + N`` columns (the prefix columns, all True, then the tree columns),
    blocks concatenated in request order: ``sum(seq_lens) * N + bs * N * N`` entries;
  - ``QLEN_ONLY`` (1): bool ``[bs*N*N]``, the tree columns only;
  - ``QLEN_ONLY_BITPACKING`` (2): one integer per row, ``[bs*N]`` of uint8 (``N <= 8``),
    uint16 (``N <= 16``) or uint32 (``N <= 32``), bit ``j`` set iff the row attends to tree
    column ``j`` (bit 0: the root; bytes little-endian). SGLang has no wider type: its
    allocation indexes ``[uint8, uint16, uint32]`` by ``ceil(log2((N + 7) // 8))``, which
    fails for ``N > 32``; so does :func:`pack_tree_mask`.

**SGLang's verify outputs**: ``predicts [bs*N]`` (at each accepted row the token that
follows it: the next accepted draft token, or the bonus at the last one; other rows are left
as allocated, zeros in SGLang), ``accept_index [bs, S]`` (accepted *global* rows ``b*N + i``,
root first, ``-1`` padded; ``S`` = ``num_speculative_tokens``, the longest path the kernel
walks, root included) and ``accept_token_num [bs]`` (accepted draft tokens, bonus excluded).
SGLang allocates the three as int32.

**Padding.** A lab tree with fewer than ``N`` nodes has padding rows (token -1,
``retrieve_index`` -1). They are carried over unchanged: ``retrive_index`` -1 marks them on
the way back. SGLang's own trees are always full.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from .._arguments import check_shape, check_tensor
from ..buffers import DDTreeVerifyInput, decode_retrieve, find_retrieve_problems, tree_attention_mask
from ..verify import VerifyOutput

__all__ = [
    "TreeMaskMode",
    "SGLangVerifyBuffers",
    "to_sglang_buffers",
    "from_sglang_buffers",
    "verify_input_from_retrieve",
    "find_sglang_buffer_problem",
    "find_sglang_buffer_problems",
    "pack_tree_mask",
    "unpack_tree_mask",
    "full_tree_mask",
    "split_full_tree_mask",
    "verify_output_to_sglang",
    "verify_output_from_sglang",
    "eagle_tree_inputs",
]


class TreeMaskMode(enum.IntEnum):
    """SGLang's ``TreeMaskMode`` (same names and values; ``spec_tree.TreeMaskMode``)."""

    FULL_MASK = 0
    QLEN_ONLY = 1
    QLEN_ONLY_BITPACKING = 2


_PACKED_DTYPES = ((8, torch.uint8), (16, torch.uint16), (32, torch.uint32))


def _packed_dtype(n: int) -> torch.dtype:
    for width, dtype in _PACKED_DTYPES:
        if n <= width:
            return dtype
    raise ValueError(
        f"QLEN_ONLY_BITPACKING holds at most 32 tree columns (SGLang packs rows into uint8/uint16/uint32), got N = {n}"
    )


@dataclass(frozen=True)
class SGLangVerifyBuffers:
    """One batch in SGLang's verify layout (module docstring).

    Attributes:
        draft_token: ``[bs*N]`` int64, the candidates, root first per request.
        retrive_index, retrive_next_token, retrive_next_sibling: ``[bs, N]`` int64.
        positions: ``[bs*N]`` int64.
        tree_mask: layout given by ``tree_mask_mode``.
        tree_mask_mode: :class:`TreeMaskMode`.
        seq_lens: ``[bs]`` int64, tokens in the KV cache before the root (SGLang's
            ``seq_lens`` at verify time: the prefix columns of a ``FULL_MASK``).
        draft_token_num: ``N``.
    """

    draft_token: torch.Tensor
    retrive_index: torch.Tensor
    retrive_next_token: torch.Tensor
    retrive_next_sibling: torch.Tensor
    positions: torch.Tensor
    tree_mask: torch.Tensor
    tree_mask_mode: TreeMaskMode
    seq_lens: torch.Tensor
    draft_token_num: int

    @property
    def batch_size(self) -> int:
        return int(self.retrive_index.shape[0])

    @property
    def candidates(self) -> torch.Tensor:
        """``draft_token`` viewed ``[bs, N]`` (what SGLang's verify kernels take)."""
        return self.draft_token.view(self.batch_size, self.draft_token_num)


# ---- tree masks ------------------------------------------------------------------------------


def pack_tree_mask(mask: torch.Tensor) -> torch.Tensor:
    """``[bs, N, N]`` bool -> ``QLEN_ONLY_BITPACKING`` ``[bs*N]`` uint8/uint16/uint32.

    Bit ``j`` of row ``i`` is ``mask[b, i, j]`` (bit 0 the root).

    Raises:
        ValueError: ``N > 32`` (SGLang has no packed type for it).
    """
    check_tensor("mask", mask, dtype=torch.bool, ndim=3)
    bs, n, n2 = mask.shape
    if n != n2:
        raise ValueError(f"mask must be [bs, N, N], got {tuple(mask.shape)}")
    dtype = _packed_dtype(n)
    weights = torch.ones(n, dtype=torch.int64, device=mask.device) << torch.arange(n, device=mask.device)
    packed = (mask.long() * weights).sum(-1).reshape(bs * n)
    return packed.to(dtype)


def unpack_tree_mask(packed: torch.Tensor, draft_token_num: int) -> torch.Tensor:
    """``QLEN_ONLY_BITPACKING`` ``[bs*N]`` -> ``[bs, N, N]`` bool (inverse of :func:`pack_tree_mask`).

    Accepts the uint8/uint16/uint32 tensor SGLang allocates, or any integer tensor with one
    value per row; bits at or past ``N`` must be clear.
    """
    if not isinstance(packed, torch.Tensor) or packed.dim() != 1:
        raise ValueError(f"packed tree mask must be a 1-D tensor [bs*N], got {getattr(packed, 'shape', type(packed))}")
    if packed.dtype.is_floating_point or packed.dtype == torch.bool:
        raise TypeError(f"packed tree mask must be an integer tensor, got {packed.dtype}")
    n = int(draft_token_num)
    if packed.numel() % n:
        raise ValueError(f"packed tree mask has {packed.numel()} rows, not a multiple of N = {n}")
    values = packed.to(torch.int64)
    if (values >> n).ne(0).any():
        row = int(((values >> n) != 0).nonzero()[0])
        raise ValueError(f"packed tree mask row {row}: bits set at or past column N = {n}")
    bits = (values[:, None] >> torch.arange(n, device=packed.device)) & 1
    return bits.bool().view(-1, n, n)


def full_tree_mask(mask: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """``[bs, N, N]`` bool -> SGLang ``FULL_MASK`` flat bool (prefix columns True)."""
    check_tensor("mask", mask, dtype=torch.bool, ndim=3)
    check_tensor("seq_lens", seq_lens, dtype=torch.int64, ndim=1)
    bs, n, _ = mask.shape
    check_shape("seq_lens", seq_lens, (bs,))
    parts = []
    for b, s in enumerate(seq_lens.tolist()):
        block = torch.ones(n, s + n, dtype=torch.bool, device=mask.device)
        block[:, s:] = mask[b]
        parts.append(block.reshape(-1))
    if not parts:
        return torch.zeros(0, dtype=torch.bool, device=mask.device)
    return torch.cat(parts)


def split_full_tree_mask(flat: torch.Tensor, seq_lens: torch.Tensor, draft_token_num: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang ``FULL_MASK`` -> (``[bs, N, N]`` tree columns, ``[bs]`` bool: every prefix column True).

    Raises:
        ValueError: ``flat`` is not ``sum(seq_lens) * N + bs * N * N`` long.
    """
    check_tensor("seq_lens", seq_lens, dtype=torch.int64, ndim=1)
    n = int(draft_token_num)
    lens = seq_lens.tolist()
    want = sum(lens) * n + len(lens) * n * n
    if flat.dim() != 1 or flat.numel() != want:
        raise ValueError(
            f"FULL_MASK must be flat with sum(seq_lens)*N + bs*N*N = {want} entries, got shape {tuple(flat.shape)}"
        )
    tree, prefix_ok, start = [], [], 0
    for s in lens:
        block = flat[start : start + n * (s + n)].view(n, s + n).bool()
        tree.append(block[:, s:])
        prefix_ok.append(bool(block[:, :s].all()))
        start += n * (s + n)
    if not tree:
        return torch.zeros(0, n, n, dtype=torch.bool), torch.zeros(0, dtype=torch.bool)
    return torch.stack(tree), torch.tensor(prefix_ok, dtype=torch.bool)


# ---- buffers ---------------------------------------------------------------------------------


def to_sglang_buffers(
    verify_input: DDTreeVerifyInput,
    tree_mask_mode: TreeMaskMode | int = TreeMaskMode.FULL_MASK,
    seq_lens: torch.Tensor | None = None,
) -> SGLangVerifyBuffers:
    """The lab's verify input in SGLang's layout (module docstring), unchanged in meaning.

    Args:
        verify_input: from :func:`ddtree_lab.compile_retrieve`.
        tree_mask_mode: which of SGLang's three mask layouts to produce.
        seq_lens: ``[bs]`` int64 prefix lengths; default the root positions
            (``verify_input.positions[:, 0]``), which is what :func:`compile_retrieve` used.

    Returns:
        :class:`SGLangVerifyBuffers`; tensors are new (the lab's are not aliased).
    """
    if not isinstance(verify_input, DDTreeVerifyInput):
        raise TypeError(f"verify_input must be a DDTreeVerifyInput, got {type(verify_input).__name__}")
    mode = TreeMaskMode(int(tree_mask_mode))
    bs, n = verify_input.node_token_ids.shape
    if seq_lens is None:
        seq_lens = verify_input.positions[:, 0].clone()
    check_tensor("seq_lens", seq_lens, dtype=torch.int64, ndim=1)
    check_shape("seq_lens", seq_lens, (bs,))
    if mode == TreeMaskMode.FULL_MASK:
        mask = full_tree_mask(verify_input.tree_mask, seq_lens)
    elif mode == TreeMaskMode.QLEN_ONLY:
        mask = verify_input.tree_mask.reshape(-1).clone()
    else:
        mask = pack_tree_mask(verify_input.tree_mask)
    return SGLangVerifyBuffers(
        draft_token=verify_input.node_token_ids.reshape(-1).clone(),
        retrive_index=verify_input.retrieve_index.clone(),
        retrive_next_token=verify_input.retrieve_next_token.clone(),
        retrive_next_sibling=verify_input.retrieve_next_sibling.clone(),
        positions=verify_input.positions.reshape(-1).clone(),
        tree_mask=mask,
        tree_mask_mode=mode,
        seq_lens=seq_lens.clone(),
        draft_token_num=n,
    )


def _tree_part(buffers: SGLangVerifyBuffers) -> torch.Tensor:
    n = buffers.draft_token_num
    if buffers.tree_mask_mode == TreeMaskMode.FULL_MASK:
        return split_full_tree_mask(buffers.tree_mask, buffers.seq_lens, n)[0]
    if buffers.tree_mask_mode == TreeMaskMode.QLEN_ONLY:
        return buffers.tree_mask.reshape(-1, n, n).bool()
    return unpack_tree_mask(buffers.tree_mask, n)


def from_sglang_buffers(buffers: SGLangVerifyBuffers, num_nodes: torch.Tensor | None = None) -> DDTreeVerifyInput:
    """SGLang's verify buffers as a lab :class:`DDTreeVerifyInput` (inverse of :func:`to_sglang_buffers`).

    The tree comes from the retrieve links (``depths`` by walking them); ``tree_mask`` and
    ``positions`` are taken from the buffers as they are, so a broken mask stays visible:
    :func:`find_sglang_buffer_problem` says where it disagrees with the links.

    Args:
        buffers: :class:`SGLangVerifyBuffers`.
        num_nodes: ``[bs]`` int64; default: the rows whose ``retrive_index`` is not -1.

    Raises:
        RetrieveError: the links are not a tree.
    """
    bs, n = buffers.batch_size, buffers.draft_token_num
    check_shape("draft_token", buffers.draft_token, (bs * n,))
    if num_nodes is None:
        num_nodes = (buffers.retrive_index >= 0).sum(1).to(torch.int64)
    _, depths = decode_retrieve(buffers.retrive_next_token, buffers.retrive_next_sibling, num_nodes)
    return DDTreeVerifyInput(
        node_token_ids=buffers.candidates.to(torch.int64).clone(),
        retrieve_index=buffers.retrive_index.to(torch.int64).clone(),
        retrieve_next_token=buffers.retrive_next_token.to(torch.int64).clone(),
        retrieve_next_sibling=buffers.retrive_next_sibling.to(torch.int64).clone(),
        tree_mask=_tree_part(buffers).clone(),
        positions=buffers.positions.view(bs, n).to(torch.int64).clone(),
        depths=depths.to(buffers.retrive_index.device),
        num_nodes=num_nodes.to(torch.int64),
    )


def verify_input_from_retrieve(
    candidates: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    retrive_index: torch.Tensor | None = None,
    seq_lens: torch.Tensor | int = 0,
) -> DDTreeVerifyInput:
    """A lab :class:`DDTreeVerifyInput` from what SGLang's verify kernels are called with.

    The kernels see no mask and no positions; both are rebuilt from the links (ancestor-or-self
    mask, ``seq_lens + depth``).

    Args:
        candidates: ``[bs, N]`` integer, root first.
        retrive_next_token, retrive_next_sibling: ``[bs, N]`` integer.
        retrive_index: ``[bs, N]``; rows with -1 are padding (default: none).
        seq_lens: ``[bs]`` int64 or an int, prefix lengths for ``positions``.

    Raises:
        RetrieveError: the links are not a tree.
    """
    bs, n = candidates.shape
    nt = retrive_next_token.to(torch.int64)
    ns = retrive_next_sibling.to(torch.int64)
    if retrive_index is None:
        ri = torch.arange(bs * n, dtype=torch.int64, device=candidates.device).view(bs, n)
    else:
        ri = retrive_index.to(torch.int64)
    num_nodes = (ri >= 0).sum(1).to(torch.int64)
    for b in range(bs):  # rows no link reaches, at the end, are padding (SGLang never marks them)
        reached = _reachable(nt[b].tolist(), ns[b].tolist(), int(num_nodes[b]))
        if reached < int(num_nodes[b]) and all(0 <= v < reached or v == -1 for v in nt[b, :reached].tolist() + ns[b, :reached].tolist()):
            num_nodes[b] = reached
    parents, depths = decode_retrieve(nt, ns, num_nodes)
    if isinstance(seq_lens, int):
        seq_lens = torch.full((bs,), seq_lens, dtype=torch.int64)
    real = torch.arange(n)[None, :] < num_nodes[:, None]
    return DDTreeVerifyInput(
        node_token_ids=torch.where(real, candidates.to(torch.int64).cpu(), -1),
        retrieve_index=torch.where(real, ri.cpu(), -1),
        retrieve_next_token=nt.cpu().clone(),
        retrieve_next_sibling=ns.cpu().clone(),
        tree_mask=tree_attention_mask(parents, num_nodes),
        positions=seq_lens.cpu()[:, None] + depths.clamp(min=0),
        depths=depths,
        num_nodes=num_nodes,
    )


def _reachable(nt: list[int], ns: list[int], count: int) -> int:
    """Length of the prefix 0..k-1 of nodes that the links reach from the root (k <= count)."""
    seen, stack, steps = {0}, [0], 0
    while stack and steps <= 4 * count:
        c = nt[stack.pop()]
        while c != -1 and 0 <= c < count and c not in seen and steps <= 4 * count:
            steps += 1
            seen.add(c)
            stack.append(c)
            c = ns[c]
    k = 0
    while k in seen:
        k += 1
    return k if len(seen) == k else count


def find_sglang_buffer_problems(buffers: SGLangVerifyBuffers, num_nodes: torch.Tensor | None = None) -> list[str]:
    """Every place where SGLang buffers disagree with themselves (the doctor's check), in order.

    Checked: the mask has SGLang's size (and, bit-packed, dtype) for its mode; per request, every
    ``FULL_MASK`` prefix column is True; the links form a tree
    (:func:`ddtree_lab.buffers.find_retrieve_problems`, ``retrive_index`` included: every
    broken link, not only the first); each mask row that misses an ancestor or sees a
    non-ancestor (one line per row, naming the columns); each position that is not
    ``seq_lens + depth``. A request whose links are broken gets those lines only (its mask and
    positions cannot be judged). Padding rows (past ``num_nodes``,
    default the rows whose ``retrive_index`` is not -1) are not checked. O(N^2) per request
    (the mask). SGLang's sibling walks have no hop bound: a cyclic chain hangs its kernels, and
    is reported here with the nodes it revisits.

    Returns:
        lines ``"request b, row i: ..."`` (or about the whole mask); empty when consistent.
    """
    bs, n = buffers.batch_size, buffers.draft_token_num
    if num_nodes is None:
        num_nodes = (buffers.retrive_index >= 0).sum(1).to(torch.int64)
    problems: list[str] = []
    tree = prefix_ok = None
    mode = buffers.tree_mask_mode
    try:
        if mode == TreeMaskMode.FULL_MASK:
            tree, prefix_ok = split_full_tree_mask(buffers.tree_mask, buffers.seq_lens, n)
        elif mode == TreeMaskMode.QLEN_ONLY:
            if buffers.tree_mask.numel() != bs * n * n:
                problems.append(f"QLEN_ONLY mask has {buffers.tree_mask.numel()} entries, expected bs*N*N = {bs * n * n}")
            else:
                tree = _tree_part(buffers)
        else:
            if buffers.tree_mask.numel() != bs * n:
                problems.append(f"QLEN_ONLY_BITPACKING mask has {buffers.tree_mask.numel()} rows, expected bs*N = {bs * n}")
            elif buffers.tree_mask.dtype != _packed_dtype(n):
                problems.append(f"QLEN_ONLY_BITPACKING mask has dtype {buffers.tree_mask.dtype}, SGLang uses "
                                f"{_packed_dtype(n)} for N = {n}")
            else:
                tree = _tree_part(buffers)
    except ValueError as err:
        problems.append(str(err))
    positions = buffers.positions.view(bs, n)
    links: dict[int, list[str]] = {}
    for p in find_retrieve_problems(buffers.retrive_next_token, buffers.retrive_next_sibling, num_nodes,
                                    retrieve_index=buffers.retrive_index):  # SGLang's rows: b * N + i
        assert p.request is not None  # every retrieve problem names its request
        links.setdefault(p.request, []).append(str(p))
    for b in range(bs):
        count = int(num_nodes[b])
        if prefix_ok is not None and not bool(prefix_ok[b]):
            problems.append(f"request {b}: a FULL_MASK prefix column is False (the tree rows must see the whole prefix)")
        one = slice(b, b + 1)
        if b in links:
            problems.extend(links[b])
            continue
        parents, depths = decode_retrieve(buffers.retrive_next_token[one], buffers.retrive_next_sibling[one], num_nodes[one])
        if tree is not None:
            want = tree_attention_mask(parents, num_nodes[one])[0, :count, :count]
            got = tree[b, :count, :count]
            for i in (got != want).any(-1).nonzero().flatten().tolist():
                missing = (want[i] & ~got[i]).nonzero().flatten().tolist()
                extra = (got[i] & ~want[i]).nonzero().flatten().tolist()
                what = ([f"misses ancestor column(s) {missing}"] if missing else []) + \
                       ([f"attends to non-ancestor column(s) {extra}"] if extra else [])
                problems.append(f"request {b}, row {i}: the mask {' and '.join(what)}")
        want_pos = int(buffers.seq_lens[b]) + depths[0, :count]
        for i in (positions[b, :count] != want_pos).nonzero().flatten().tolist():
            problems.append(f"request {b}, row {i}: position {int(positions[b, i])}, expected seq_len + depth = "
                            f"{int(want_pos[i])}")
    return problems


def find_sglang_buffer_problem(buffers: SGLangVerifyBuffers, num_nodes: torch.Tensor | None = None) -> str | None:
    """The first of :func:`find_sglang_buffer_problems`, or None."""
    problems = find_sglang_buffer_problems(buffers, num_nodes)
    return problems[0] if problems else None


# ---- outputs ---------------------------------------------------------------------------------


def verify_output_to_sglang(
    output: VerifyOutput, draft_token_num: int, num_speculative_tokens: int | None = None, fill: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A lab :class:`VerifyOutput` as SGLang's ``(predicts, accept_index, accept_token_num)``.

    Args:
        output: lab verify output.
        draft_token_num: ``N``.
        num_speculative_tokens: ``S``, width of ``accept_index``; default the lab's width.
        fill: value of the ``predicts`` rows off the accepted path (SGLang: 0).

    Returns:
        int32 tensors ``predicts [bs*N]``, ``accept_index [bs, S]`` (global rows),
        ``accept_token_num [bs]``. A request whose support was exhausted (no bonus) gets
        ``-1`` at its last accepted row.
    """
    bs, width = output.accept_index.shape
    s = width if num_speculative_tokens is None else int(num_speculative_tokens)
    lengths = output.accept_length.tolist()
    if lengths and max(lengths) + 1 > s:
        raise ValueError(f"num_speculative_tokens = {s} is shorter than an accepted path ({max(lengths) + 1} rows)")
    predicts = torch.full((bs * draft_token_num,), fill, dtype=torch.int32)
    accept_index = torch.full((bs, s), -1, dtype=torch.int32)
    for b in range(bs):
        k = lengths[b]
        rows = output.accept_index[b, : k + 1] + b * draft_token_num
        accept_index[b, : k + 1] = rows.to(torch.int32)
        following = output.emitted_tokens[b, : k + 1]
        predicts[rows] = following.to(torch.int32)
    return predicts, accept_index, output.accept_length.to(torch.int32).clone()


def verify_output_from_sglang(
    verify_input: DDTreeVerifyInput,
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    backend: str = "sglang",
) -> VerifyOutput:
    """SGLang's verify outputs as a lab :class:`VerifyOutput` (no decision log).

    ``accept_index`` becomes local node indices (``row - b*N``); ``emitted_tokens`` are the
    accepted nodes' draft tokens then ``predicts`` at the last accepted row (the bonus).

    Raises:
        ValueError: an accepted row outside its request, or ``predicts`` at an accepted row
            that disagrees with the next accepted node's token (a corrupt output).
    """
    bs, n = verify_input.node_token_ids.shape
    check_shape("predicts", predicts, (bs * n,))
    if accept_index.dim() != 2 or accept_index.shape[0] != bs:
        raise ValueError(f"accept_index must be [bs={bs}, S], got {tuple(accept_index.shape)}")
    check_shape("accept_token_num", accept_token_num, (bs,))
    s = int(accept_index.shape[1])
    width = max(s, int(verify_input.depths.max()) + 1 if verify_input.depths.numel() else 1)
    local = torch.full((bs, width), -1, dtype=torch.int64)
    emitted = torch.full((bs, width), -1, dtype=torch.int64)
    bonus = torch.full((bs,), -1, dtype=torch.int64)
    pred = predicts.to(torch.int64)
    tokens = verify_input.node_token_ids
    for b in range(bs):
        k = int(accept_token_num[b])
        if not 0 <= k < s:
            raise ValueError(f"request {b}: accept_token_num {k} outside [0, {s - 1}]")
        rows = accept_index[b, : k + 1].to(torch.int64)
        if ((rows < b * n) | (rows >= (b + 1) * n)).any():
            raise ValueError(f"request {b}: accept_index {rows.tolist()} has rows outside [{b * n}, {(b + 1) * n})")
        nodes = rows - b * n
        local[b, : k + 1] = nodes
        drafted = tokens[b, nodes[1:]]
        if not torch.equal(pred[rows[:-1]], drafted):
            raise ValueError(
                f"request {b}: predicts at accepted rows {pred[rows[:-1]].tolist()} disagree with the accepted tokens {drafted.tolist()}"
            )
        bonus[b] = pred[rows[-1]]
        emitted[b, :k] = drafted
        emitted[b, k] = bonus[b]
    return VerifyOutput(
        accept_index=local,
        accept_length=accept_token_num.to(torch.int64).clone(),
        emitted_tokens=emitted,
        bonus_token=bonus,
        support_exhausted=torch.zeros(bs, dtype=torch.bool),
        decisions=[[] for _ in range(bs)],
        bonus=[],
        backend=backend,
    )



# ---- SGLang's tree builder's inputs (EAGLE) ----------------------------------------------------


def eagle_tree_inputs(verify_input: DDTreeVerifyInput) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Express lab trees in the inputs of SGLang's EAGLE tree builder (``build_tree_kernel_efficient``).

    SGLang's builder gets, per request, ``selected_index [N-1]`` (node ``i``'s index in the
    drafter's flattened score list) and ``parent_list [topk*(depth-1)+1]``: node ``i``'s
    parent is the root when ``selected_index[i-1] // topk == 0``, else the node whose
    ``selected_index`` equals ``parent_list[selected_index[i-1] // topk]``. Here node ``i``
    gets ``g(parent) * topk + (its rank among its siblings)``, where ``g`` numbers the nodes
    that have children (root 0), so any tree with at most ``topk`` children per node is
    expressible; the builder then links children in ascending index, as the lab does.

    Returns:
        ``(parent_list [bs, topk*(depth-1)+1], selected_index [bs, N-1], topk, depth)``, int64.

    Raises:
        ValueError: a request with padding rows (SGLang's builder has no padding).
    """
    bs, n = verify_input.node_token_ids.shape
    if (verify_input.num_nodes != n).any():
        b = int((verify_input.num_nodes != n).nonzero()[0])
        raise ValueError(f"request {b}: SGLang's tree builder needs a full tree of N = {n} nodes, got {int(verify_input.num_nodes[b])}")
    parents, _ = decode_retrieve(verify_input.retrieve_next_token, verify_input.retrieve_next_sibling, verify_input.num_nodes)
    children = [[[i for i in range(1, n) if int(parents[b, i]) == p] for p in range(n)] for b in range(bs)]
    topk = max(1, max(len(c) for req in children for c in req))
    internal = max(sum(1 for p in range(1, n) if req[p]) for req in children)
    max_depth = int(verify_input.depths.max())
    depth = max(max_depth, -(-internal // topk) + 1) + 1
    parent_list = torch.full((bs, topk * (depth - 1) + 1), -1, dtype=torch.int64)
    selected = torch.full((bs, max(n - 1, 0)), -1, dtype=torch.int64)
    for b in range(bs):
        group = {0: 0}
        flat = {}
        for i in range(1, n):
            p = int(parents[b, i])
            flat[i] = group[p] * topk + children[b][p].index(i)
            selected[b, i - 1] = flat[i]
            if children[b][i]:
                group[i] = len(group)
                parent_list[b, group[i]] = flat[i]
    return parent_list, selected, topk, depth

