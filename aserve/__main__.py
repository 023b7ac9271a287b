"""`python -m aserve`: see `aserve.server.cli`."""

from aserve.server.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
