"""``python -m mmspec_cli``: the same command line as the ``mmspec`` script."""

from mmspec_cli.cli.app import main

main()
