"""Training the shipped demo family (``scripts/train_demo.py``): data, models, the build plan."""
