"""``python -m infra.docgen [--check]``: write the reference pages, or (``--check``) exit
1 naming those out of date."""

from __future__ import annotations

import argparse
import sys

from infra.docgen import stale, write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.docgen", description=__doc__)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    if args.check:
        out = stale()
        for path in out:
            print(f"{path} is out of date: run `just docs-reference`")
        return 1 if out else 0
    for path in write():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
