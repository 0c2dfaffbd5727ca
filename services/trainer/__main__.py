import sys

from services.trainer.cli import main

sys.exit(main(sys.argv[1]))
