"""``python -m services.trainer CONFIG``: what ``polar train CONFIG`` runs."""

import sys

from services.trainer.cli import main

if len(sys.argv) != 2:
    print("usage: python -m services.trainer CONFIG", file=sys.stderr)
    sys.exit(1)
sys.exit(main(sys.argv[1]))
