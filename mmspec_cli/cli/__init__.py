"""The ``mmspec`` command line (``app.py``), one module per command."""
