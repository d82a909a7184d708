"""`python -m publisher.cli`: the `ome-publisher` command."""
import sys

from publisher.cli import main

sys.exit(main())
