"""aserve.runner."""
