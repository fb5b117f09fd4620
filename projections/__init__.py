"""The read side: the inline lock_state projection, queries over it, and its rebuild from the log."""
