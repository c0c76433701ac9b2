"""Events, the Redis replay buffer, the flush path and the stream readers."""
