"""Code shared by the draft, verify and gateway services."""
