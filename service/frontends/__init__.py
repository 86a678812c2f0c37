"""`--http-workers`: the front-end processes, their supervisor, the arena and the channel."""
