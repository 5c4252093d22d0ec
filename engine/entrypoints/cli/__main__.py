"""`python -m stepscope.engine.entrypoints.cli ...`: the `stepscope` command."""

from stepscope.engine.entrypoints.cli.main import main

if __name__ == "__main__":
    main()
