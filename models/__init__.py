"""The embedded default model pair (target/, draft/) and the recipe that made it."""
