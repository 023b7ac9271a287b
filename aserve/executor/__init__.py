"""aserve.executor."""
