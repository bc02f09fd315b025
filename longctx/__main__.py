"""`python -m longctx` runs the CLI."""

from longctx.cli import main

main()
