"""Print the inventory of the installed engines' sampled-verify and draft-sampling entry points
(ddtree_lab.engines.inventory), or write it into docs/ENGINES.md's generated blocks.

    python scripts/engine_inventory.py                 # print; exit 1 if the engines differ from the inventory
    python scripts/engine_inventory.py --write-docs    # regenerate docs/ENGINES.md's tables

vLLM is read through its venv (DDTREE_LAB_VLLM_VENV, default .venv-vllm); without it its block
is left as it is and the script says so.
"""

import argparse
import sys
from pathlib import Path

from ddtree_lab.engines import inventory as inv

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--write-docs", action="store_true", help="rewrite the generated tables of docs/ENGINES.md")
    args = ap.parse_args()
    try:
        found = inv.inventory()
    except inv.InventoryError as err:
        print(err, file=sys.stderr)
        return 1
    print(inv.inventory_table(found))
    if args.write_docs:
        ready = {e: v for e, v in found.items() if not v["missing"]}
        for e, v in found.items():
            if v["missing"]:
                print(f"{e}: {v['missing']}: its block in docs/ENGINES.md is left as it is", file=sys.stderr)
        inv.write_doc_blocks(ROOT / "docs" / "ENGINES.md", ready)
        print(f"wrote {', '.join(ready)} into docs/ENGINES.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
