"""Loading models and what they read: profiles, prompts, images. Importing this package imports no torch."""
