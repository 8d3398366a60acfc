"""Session set-up shared by every test module."""
