"""aserve.distributed."""
