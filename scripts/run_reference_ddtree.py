"""Run the DDTree authors' ``ddtree_generate`` with the lab's target and DFlash drafter; write its tree traces.

Writes ``fixtures/ddtree_reference/smollm2_dflash_greedy.jsonl``: one JSON line per prompt,
``vars(result)`` of the reference's ``ddtree_generate(..., temperature=0, save_tree_traces=True)``
(``output_ids`` as a nested list) plus ``prompt``, ``max_new_tokens``, ``tree_budget`` and
``temperature``. The lab's live run of the same prompts (``LiveSession``, same budget and
``max_new_tokens``, greedy) builds the same trees and accepts the same paths round for round;
``tests/test_reference_vs_lab.py`` checks that, and the one difference, the rounds past the lab's
last one (``ddtree_lab.views.compare.STOPPING_RULE``).

The reference code is not part of this repository: pass a checkout of GitHub
``liranringel/ddtree`` with ``--ddtree`` (its ``ddtree.py``, ``dflash.py`` and ``model/`` are
imported from there, unchanged). The target is the lab's SmolLM2-135M-Instruct (the weights
``ddtree_lab.models.load_default`` converts, loaded with ``AutoModelForCausalLM``; prompts
through the lab's chat template), the drafter ``fixtures/drafters/smollm2_dflash_b16`` loaded by
the reference's own ``DFlashDraftModel``, float32 on the CPU. Three adaptations, none of them
to the algorithm:

* the reference times stages with ``torch.cuda.synchronize()``; on a machine without CUDA its
  ``cuda_time`` is replaced by ``time.perf_counter`` (so the stage times are CPU seconds);
* transformers 5 refuses ``DynamicCache.crop(n)`` with ``n >= 0``, which the reference calls to
  keep the first ``n`` tokens; that meaning is restored for the run (a negative ``n`` is passed
  through unchanged);
* ``loguru`` (one warning) and ``datasets`` (the benchmark's data loading), which the
  reference imports but ``ddtree_generate`` does not use, get empty stand-in modules when they
  are not installed.

Usage: python scripts/run_reference_ddtree.py --ddtree PATH [--prompts 6] [--max-new-tokens 32]
       [--budget 32] [--out fixtures/ddtree_reference/smollm2_dflash_greedy.jsonl]
(about a minute per prompt on one CPU thread).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DRAFTER = ROOT / "fixtures" / "drafters" / "smollm2_dflash_b16"
PROMPTS = ROOT / "fixtures" / "drafters" / "dflash_prompts.json"
OUT = ROOT / "fixtures" / "ddtree_reference" / "smollm2_dflash_greedy.jsonl"


def _stand_in(name: str, **attrs) -> None:
    """An empty module ``name`` when the real one is not installed (imported, never used)."""
    try:
        __import__(name)
    except ImportError:
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod


def _unused(*args, **kwargs):
    raise RuntimeError("a stand-in module: ddtree_generate does not use it")


def import_reference(path: Path):
    """``(ddtree module, DFlashDraftModel)`` from a checkout of liranringel/ddtree, with the
    adaptations of the module docstring."""
    import logging

    import torch
    from transformers import DynamicCache

    if not (path / "ddtree.py").is_file():
        raise SystemExit(f"{path}: no ddtree.py here (pass a checkout of liranringel/ddtree with --ddtree)")
    _stand_in("loguru", logger=logging.getLogger("ddtree"))
    _stand_in("datasets", load_dataset=_unused, Features=object, Sequence=object, Value=object)
    sys.path.insert(0, str(path))
    # the reference's modules, from the checkout (not installed, so unknown to a type checker)
    import dflash as ref_dflash  # pyright: ignore[reportMissingImports]
    import ddtree as ref_ddtree  # pyright: ignore[reportMissingImports]
    from model import DFlashDraftModel  # pyright: ignore[reportMissingImports]

    if not torch.cuda.is_available():
        ref_dflash.cuda_time = ref_ddtree.cuda_time = time.perf_counter
    crop = DynamicCache.crop

    def keep_first(self, max_length: int):  # transformers < 5: crop(n >= 0) keeps the first n tokens
        if max_length < 0:
            return crop(self, max_length)
        excess = self.get_seq_length() - max_length
        return crop(self, -excess) if excess > 0 else None

    setattr(DynamicCache, "crop", keep_first)
    return ref_ddtree, DFlashDraftModel


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run the DDTree authors' ddtree_generate with the lab's target and "
                                             "DFlash drafter; write its tree traces as JSONL.")
    ap.add_argument("--ddtree", type=Path, required=True, help="a checkout of GitHub liranringel/ddtree")
    ap.add_argument("--prompts", type=int, default=6, help="the first N held-out prompts of dflash_prompts.json")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--budget", type=int, default=32, help="the tree budget (draft nodes)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--drafter", type=Path, default=DRAFTER, help="the DFlash checkpoint directory (default: the shipped one)")
    args = ap.parse_args(argv)
    if args.out.exists():
        raise SystemExit(f"{args.out} exists: remove it first (this script never replaces a file)")
    ref_ddtree, DFlashDraftModel = import_reference(args.ddtree.resolve())
    import torch
    from transformers import AutoModelForCausalLM

    from ddtree_lab.models.loading import load_default

    lab_target, _ = load_default("cpu")
    target = AutoModelForCausalLM.from_pretrained(lab_target.model.config._name_or_path, dtype=torch.float32).eval()
    drafter = DFlashDraftModel.from_pretrained(str(args.drafter), dtype=torch.float32).eval()
    prompts = json.loads(PROMPTS.read_text())["held_out"][: args.prompts]
    lines = []
    for k, prompt in enumerate(prompts):
        ids = torch.tensor([lab_target.encode_prompt(prompt, chat=True)])
        result = ref_ddtree.ddtree_generate(drafter, target, ids, drafter.mask_token_id, args.max_new_tokens,
                                            drafter.block_size, sorted(lab_target.eos_token_ids), temperature=0.0,
                                            tree_budget=args.budget, save_tree_traces=True)
        record = dict(vars(result), output_ids=result.output_ids.tolist(), prompt=prompt,
                      max_new_tokens=args.max_new_tokens, tree_budget=args.budget, temperature=0.0)
        lines.append(json.dumps(record))
        print(f"prompt {k}: {record['decode_rounds']} rounds, tau {record['acceptance_lengths']}", file=sys.stderr)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
