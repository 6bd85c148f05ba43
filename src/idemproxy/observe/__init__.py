"""What the proxy tells about itself: its metrics and its log lines (SPEC §13)."""
