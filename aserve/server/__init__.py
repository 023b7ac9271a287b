"""aserve.server."""
