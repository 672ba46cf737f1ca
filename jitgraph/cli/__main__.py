"""`python -m jitgraph.cli`: the `jitgraph` command."""
import sys

from .main import main

sys.exit(main())
