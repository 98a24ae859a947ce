"""Write labs/05_audit.ipynb (the losslessness audit) from its cell sources, then execute it in
place so it carries static outputs (tables, plots) that read without a kernel.

    python scripts/make_notebook_audit.py [--no-execute]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import nbformat
from notebook_outputs import execute

LABS = Path(__file__).resolve().parent.parent / "labs"

CELLS = [
    ("md", """# 05 · Losslessness audit of a verifier

A verify step is **lossless** when, over the coins, the tokens it emits have exactly the law of
sampling them one by one from the target. For one step (tree, target logits, sampling
parameters) that law is computable exactly: here the joint law of the **first emitted token**
and the **accepted depth** (the vocabulary is SmolLM2's 49,152 tokens; small cases enumerate
whole sequences). `ddtree_lab.audit` draws thousands of coin sets, runs a verifier on the step
and tests its empirical law against the exact one (G-test, fixed seed, rare cells pooled).

The step below is real: step 27 of request 1 in `fixtures/traces/smollm2_t08_b32` (temperature
0.8), with the target's full logits recomputed by one tree forward of SmolLM2-135M. The same
audit runs from the shell: `ddtree-lab audit TRACE --step 27 --request 1 --model default`."""),
    ("code", """import os
import torch

if not torch.cuda.is_available():  # before triton is imported: SGLang's kernels run interpreted below
    os.environ.setdefault("TRITON_INTERPRET", "1")
import ddtree_lab as dl
from ddtree_lab import audit as au
from ddtree_lab.models import load_default_target

torch.set_num_threads(1)
target = load_default_target()
run = dl.load_trace("../fixtures/traces/smollm2_t08_b32.ddtrace.safetensors")
step = next(s for s in run.steps if s.step == 27 and s.request == 1)
case = au.case_from_logits(step, au.step_logits(target, run, step), texts=run.token_texts)
law = au.exact_law(case)
print(f"{case.name}: {step.num_nodes} nodes, exact law over {len(law.probs)} outcomes")
print("accepted depth law:", {d: round(p, 4) for d, p in sorted(law.depth().items())})"""),
    ("md", """## The reference verifier passes

Each test line's `p` is that G-test's p-value. The verdict's `p` combines the verifier's three
tests (the outcome law and its first-token and depth marginals) by Bonferroni: `min(1, 3 x` the
smallest of the three`)`, so it reads 1 whenever the smallest is above 1/3; the plain-sampler lines
check the exact law itself and are not part of it. The lists show the outcomes furthest above and
below their expected counts. A lossless verifier fails at level 0.001 about one run in a thousand."""),
    ("code", """good = au.audit(case, "reference", draws=3000, seed=0)
print(good.text())
good.figure()"""),
    ("md", """## A planted fault is caught

`coin-reuse`: the final draw reuses the coin of the last node, which the walk has already
conditioned (`u >= S_K`, the children's mass), instead of a fresh coin: low-id tokens of the
residual are never drawn. Other planted faults: """ + "`threshold`, `temperature-1`, `greedy`, `filter-order`; "
     "duplicate sibling tokens are planted in the tree with `au.plant_duplicate_sibling(case)`."),
    ("code", """bad = au.audit(case, "coin-reuse", draws=3000, seed=0)
print(bad.text())
assert bad.rejected and not good.rejected
bad.figure()"""),
    ("md", """## Verify against the plain sampler: a filtering-order mismatch

With top-k 3 and top-p 0.6 the lab's order (top-k, renormalise, then top-p) and the other order
(top-p on the whole row, then top-k) keep different tokens. A verifier filtering in the other
order fails the audit, and its first tokens differ from the plain sampler's under the same
parameters, while the plain sampler itself matches the exact law."""),
    ("code", """import dataclasses

filtered = dataclasses.replace(case, params=dataclasses.replace(case.params, top_k=3, top_p=0.6))
other = au.audit(filtered, "filter-order", draws=3000, seed=0)
print(f"verify vs exact: p = {other.p_value:.3g}; plain sampler vs exact: p = {other.sampler.p_value:.3g}; "
      f"verify vs plain sampler: p = {other.verify_vs_sampler.p_value:.3g}")
other.figure()"""),
    ("md", """## Your own verifier

Any callable with `verify_tree`'s signature `(verify_input, target_logits, params, coins,
final_coins) -> VerifyOutput` can be audited, e.g. a wrapper around an engine's kernel:"""),
    ("code", """def my_verifier(vi, logits, params, coins, final_coins):
    return dl.verify_tree(vi, logits.contiguous(), params, coins, final_coins, backend="torch-lazy")

print(au.audit(case, my_verifier, draws=600, seed=1).verdict)"""),
    ("md", """## The engines' own verifiers: vLLM and SGLang

`ddtree_lab.engines` wraps the serving engines' own verify code as such callables. Their chain
samplers verify a **chain** (a tree with one child per node), so the case is a small random
chain at temperature 0.8 with top-k 5 / top-p 0.9:

* **SGLang** (in this venv): `chain_speculative_sampling_triton` on the lab's coins, coin for
  coin (its Triton kernel runs in the interpreter on a CPU); its greedy tree kernel for greedy
  requests; the CUDA-only `tree_speculative_sampling_target_only` on a GPU.
* **vLLM** (its own venv, made by `bash scripts/setup_vllm.sh`): `RejectionSampler.forward`
  (temperature, top-k/top-p, its three sampler kernels, the bonus sampler) in a worker process;
  vLLM draws its own randomness, seeded per draw from the lab's coins.

`draft="real"` gives the sampler real draft probabilities from a noisy drafter; the exact law
is then that of the rule given the drafted tokens (`engines.real_draft_case`). The same from the
shell: `ddtree-lab audit --engine vllm --random 1 --nodes 4 --temperature 0.8 --top-k 5 --top-p 0.9`."""),
    ("code", """from ddtree_lab import engines

chain = engines.random_chain_case(2, length=3, vocab_size=8,
                                  params=dl.SamplingParams(temperature=0.8, top_k=5, top_p=0.9))
with engines.open_engine("sglang", kernel="chain") as sgl:
    print(engines.audit_engine(sgl.make, chain, draws=600, seed=0).text(3))
with engines.open_engine("sglang", kernel="chain", fault="temperature-1") as sgl_bad:
    print(engines.audit_engine(sgl_bad.make, chain, draws=600, seed=0).verdict)"""),
    ("code", """from ddtree_lab.engines import vllm as ev

why = ev.vllm_unavailable_reason()
if why is not None:
    print(f"vLLM is not set up on this machine ({why}); the SGLang audit above is the same "
          "adapter. After `bash scripts/setup_vllm.sh` this cell audits vLLM's RejectionSampler.")
else:
    with engines.open_engine("vllm") as vl:
        print(vl.about)
        for draft in ("target-only", "real"):
            print(engines.audit_engine(vl.make, chain, draft=draft, draws=600, seed=0).text(3))"""),
]


def build() -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell(src) if kind == "md" else nbformat.v4.new_code_cell(src)
                for kind, src in CELLS]
    return nb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--no-execute", action="store_true")
    args = ap.parse_args()
    nb = build()
    if not args.no_execute:
        execute(nb, LABS, timeout=1200)
    path = LABS / "05_audit.ipynb"
    nbformat.write(nb, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
