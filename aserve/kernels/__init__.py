"""aserve.kernels."""
