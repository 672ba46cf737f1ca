"""`python -m jitgraph.cli`: the `jitgraph` command."""
from .main import command

command()
