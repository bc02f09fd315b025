"""`python -m longctx` runs the CLI."""

from longctx.cli import app

app(prog_name="longctx")
