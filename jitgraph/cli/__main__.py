"""`python -m jitgraph.cli`: the `jitgraph` command."""
import sys

from . import main

sys.exit(main())
