"""aserve.engine."""
