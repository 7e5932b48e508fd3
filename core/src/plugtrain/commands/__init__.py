"""The ``plugtrain`` sub-commands, one module each, which ``plugtrain.cli`` names in a table.

Each module has ``add_parser(subparsers, summary)``, which builds its parser, and ``run(args)``,
which runs it (``train`` takes its command line as it is: ``train(argv)``). The command imports
only the module of the sub-command that runs, so ``plugtrain --help`` imports none of them.
"""
