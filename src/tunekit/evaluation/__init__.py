"""Generation on held-out data and the metrics registry."""
