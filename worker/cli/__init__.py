"""The `kvrq` command line: `main` is the console script, `build_parser` its argparse tree.

main.py wires the subcommands; commands.py holds the Redis-client commands (generate, status,
maintenance), demo.py the demo and spawn.py the child redis-server/worker processes it starts.
"""

from worker.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
