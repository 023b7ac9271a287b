"""aserve.models."""
