"""aserve.layers."""
