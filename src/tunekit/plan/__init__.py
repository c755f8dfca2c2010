"""Memory and time per device, before a launch."""
