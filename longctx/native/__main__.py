"""`python -m longctx.native build`: build the optional native helper (see `longctx.native`)."""

import sys

from longctx import native

if __name__ == "__main__":
    if sys.argv[1:] != ["build"]:
        sys.exit("usage: python -m longctx.native build")
    try:
        print(f"built {native.build()}", file=sys.stderr)
    except (RuntimeError, ImportError) as err:
        sys.exit(f"longctx.native: {err}")
