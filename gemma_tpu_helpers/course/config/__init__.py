"""Where things are: the course's settings (paths), profiles and runs, the Hub, the tiny replica, the base
checkpoint."""
