"""`python -m carpool.runtime` serves, like `carpool serve`."""

import sys

from carpool.cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
