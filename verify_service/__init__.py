"""The verify service: the target model, the speculation round loop and its fallbacks."""
