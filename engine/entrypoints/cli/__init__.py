"""The `stepscope` command line, one module per subcommand family (as vLLM's entrypoints/cli/):
main.py builds the top parser and runs a command; serve.py (serve, demo), trace.py, bench.py,
dashboard.py and prepare.py each register their subcommands and the functions that run them.
"""

from stepscope.engine.entrypoints.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
