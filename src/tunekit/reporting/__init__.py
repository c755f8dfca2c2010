"""What runs wrote, read back: the runs listing and the HTML report page."""
