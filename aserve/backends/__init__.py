"""aserve.backends."""
