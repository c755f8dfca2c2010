"""Training data: reading, formats (a registry), rendering with exact masks, Arrow cache, packing."""
